"""HostLocalFeed: this host's rows of every step as numpy arrays, for stacks that form the
global arrays themselves.

MaxText's input pipeline, for one, takes per-host batches and makes each field a global array
with ``jax.make_array_from_process_local_data`` on its own mesh. ``HostLocalFeed`` hands it the
rows that call expects: the rows of the global batch that this process's devices hold under
``sharding``, ``[start, stop)`` of ``host_rows``, in global row order, the six fields of
``ingest.stream.chunk_format.FIELDS``::

    B=8, 2 processes     global rows 0 1 2 3 | 4 5 6 7
                         process 0 yields rows 0-3, process 1 rows 4-7, each [4, seq_len]

The steps, the streams this host owns, padding, the end of finite data and the state are the
``HostFeed``'s: ``get_state``/``set_state`` mean the same and the states are interchangeable, so
a run may switch between the two feeds at a checkpoint.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.sharding import NamedSharding

from ingest.config import Config
from ingest.stream.chunk_format import FIELDS
from jax_side.feed import HostFeed
from jax_side.sharding import HostRows

__all__ = ["HostLocalFeed", "fast_forward"]


class HostLocalFeed(HostFeed):
    """A ``HostFeed`` that yields ``dict[field, np.ndarray]`` of this host's rows per step.

    Takes ``HostFeed``'s arguments. ``sharding`` is the sharding the consumer will give the
    global arrays: it decides which rows and streams are this host's, as for ``HostFeed``.
    Each array has shape ``[rows, seq_len]`` (``rows_at(step)``), int32; the arrays of one
    step are fresh, never reused by the feed.

    ``jax.make_array_from_process_local_data(sharding, batch[f], (B_t, seq_len))`` on every
    process gives the array ``HostFeed`` yields for field ``f``.
    """

    def __iter__(self) -> HostLocalFeed:
        super().__iter__()
        return self

    def __next__(self) -> dict[str, np.ndarray]:  # type: ignore[override]
        step = self._next_step()
        return dict(zip(FIELDS, step.fields, strict=True))

    def rows_at(self, step: int) -> HostRows:
        """This host's block of global rows at 0-based ``step`` (it changes only with
        ``batch_rampup``): the rows of the arrays that step yields."""
        return self._rows_by_size[self.config.batch_size_at(step)]


def fast_forward(config: Config, *, sharding: NamedSharding, step: int, backend: str = "local",
                 state: dict[str, Any] | None = None, **feed_options: Any) -> dict[str, Any]:
    """The feed state after global step ``step``, rebuilt by reading the streams up to there.

    A stream's position after a step is known only by reading it (how many rows a document
    gives depends on the tokenizer, packing and long-document policy), and the rows are a
    function of the config and corpus alone, so reading them again rebuilds the state exactly.
    The steps are assembled on the host and dropped, never formed into device arrays; the cost
    is the reading and tokenizing of every step in between. With several JAX processes, every
    process calls it with the same arguments (the end of finite data is agreed between them).

    Args:
      config, sharding, backend, **feed_options: as for ``HostFeed``.
      step: the global step (0-based count of steps delivered) to stop after.
      state: a saved state at or before ``step`` to start from (default: step 0).

    Returns:
      The state ``HostFeed.get_state()`` gives after ``step`` steps, for ``set_state``.

    Raises:
      ValueError: ``step`` lies before ``state``'s step, or after the end of finite data.
    """
    start = int(state["step"]) if state is not None else 0
    if isinstance(step, bool) or not isinstance(step, int) or step < start:
        raise ValueError(f"fast_forward(step={step!r}): give an integer at or after the start "
                         f"state's step {start}")
    with HostLocalFeed(config, sharding=sharding, backend=backend, **feed_options) as feed:
        if state is not None:
            feed.set_state(state)
        for done in range(start, step):
            if next(feed, None) is None:
                raise ValueError(f"fast_forward(step={step}): the data ends after step {done}; "
                                 f"give a step at most {done}")
        return feed.get_state()
