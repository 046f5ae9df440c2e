"""What every stream produces: ``Chunk``, consecutive rows of one stream with its state."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["Chunk"]


@dataclasses.dataclass
class Chunk:
    """Consecutive rows of one stream, with the stream's state after the last of them.

    Attributes:
      stream_id: the stream.
      fields: int32 ``[6, num_rows, seq_len]`` in ``FIELDS`` order.
      state_after: ``StreamState.to_json()`` after the last row.
      exhausted: the stream has no rows after these (fewer than asked may have come).
      documents: int64 ``[num_rows]``: the state's ``documents`` counter as it reads after
        each row (the state itself is saved at chunk ends only); None where not counted.
    """

    stream_id: int
    fields: np.ndarray
    state_after: dict[str, Any]
    exhausted: bool
    documents: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return self.fields.shape[1]
