"""The batch digest: SHA-256 over global batches, comparable across runs, workers and hosts.

For each step, for each field in sorted name order, the field's int32 little-endian bytes in C
order (rows in global order) are hashed. ``step_digest`` hashes one step; ``BatchDigest`` hashes
every step of a run in sequence.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np

__all__ = ["BatchDigest", "step_digest"]


def _update(h, batch: Mapping[str, np.ndarray]) -> None:
    for name in sorted(batch):
        a = np.ascontiguousarray(np.asarray(batch[name]), dtype="<i4")
        h.update(a.tobytes(order="C"))


def step_digest(batch: Mapping[str, np.ndarray]) -> str:
    """SHA-256 hex digest of one global batch."""
    h = hashlib.sha256()
    _update(h, batch)
    return h.hexdigest()


class BatchDigest:
    """Running SHA-256 over every step's global batch."""

    def __init__(self):
        self._h = hashlib.sha256()
        self.steps = 0

    def update(self, batch: Mapping[str, np.ndarray]) -> None:
        _update(self._h, batch)
        self.steps += 1

    def hexdigest(self) -> str:
        return self._h.hexdigest()
