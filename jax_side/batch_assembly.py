"""Batch assembly: one step's rows of this host, then the global arrays on the user's sharding.

Stream j of the host's block gives rows ``[j*k, (j+1)*k)`` of the host's local batch (k rows
per stream at this step); a stream that ended fills the rest of its rows with zeros (padding).
The local batch ``[6, rows, seq_len]`` becomes one ``jax.Array`` per field of shape
``[B, seq_len]``, in one ``jax.make_array_from_process_local_data`` call for the six fields.
The rows are assembled on the feed's thread; the transfer runs on the consumer's
(``AssembledStep.arrays``), the thread that dispatches the training step, so that transfers
and steps reach XLA in the order the user's loop makes them::

    host rows  stream 0: r0 r1 | stream 1: r0 pad     k = 2
    local      [6, 4, seq_len] -> inputs, targets, ... each [B, seq_len] on the sharding
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from ingest.stream.chunk_format import FIELDS, RowPieces, batch_groups
from jax_side.chunk_intake import ChunkIntake
from jax_side.host_buffers import aligned_empty
from jax_side.sharding import HostRows

__all__ = ["AssembledStep", "LocalBatch", "assembled_step", "fill_local_batch", "fill_round",
           "global_arrays", "round_steps"]


def global_arrays(local: np.ndarray, sharding: NamedSharding,
                  global_batch_size: int) -> dict[str, jax.Array]:
    """The six global ``[global_batch_size, seq_len]`` arrays from this process's rows
    (``local``: ``[6, rows, seq_len]``, from ``host_buffers.aligned_empty``): what
    ``jax.make_array_from_process_local_data`` makes of each field, in one call (on one
    process, one batched ``jax.device_put``)."""
    shape = (global_batch_size, local.shape[2])
    arrays = jax.make_array_from_process_local_data(sharding, list(local), shape)
    return dict(zip(FIELDS, arrays, strict=True))


@dataclasses.dataclass
class LocalBatch:
    """One step's rows of this host.

    Attributes:
      fields: ``[6, rows, seq_len]``, the fields in ``ingest.stream.chunk_format.FIELDS`` order.
      real_rows: rows taken from the streams.
      padding_rows: all-zero rows of streams that ended.
    """

    fields: np.ndarray
    real_rows: int
    padding_rows: int


@dataclasses.dataclass
class AssembledStep:
    """A finished step, waiting for the consumer.

    Attributes:
      fields: this host's rows, ``[6, rows, seq_len]`` (``LocalBatch.fields``).
      sharding: the sharding of the global arrays.
      global_batch_size: their first dimension.
      state: the host state after this step.
      tokens: real tokens of this host's rows.
      rows: this host's rows (real and padding).
      padding_rows: of those, padding rows.
      padding_tokens: padding tokens of this host's rows.
    """

    fields: np.ndarray
    sharding: NamedSharding
    global_batch_size: int
    state: dict[str, Any]
    tokens: int
    rows: int
    padding_rows: int
    padding_tokens: int

    def arrays(self) -> dict[str, jax.Array]:
        """The global arrays, by field: call it on the thread that runs the computations
        they feed."""
        return global_arrays(self.fields, self.sharding, self.global_batch_size)


def fill_local_batch(intake: ChunkIntake, rows: HostRows, k: int, seq_len: int) -> LocalBatch:
    """Takes ``k`` rows of each of ``rows.streams`` from ``intake`` into a new local batch."""
    local = aligned_empty((len(FIELDS), rows.stop - rows.start, seq_len))
    pieces = RowPieces(seq_len)
    got = 0
    for s in rows.streams:
        n = intake.take(s, pieces, k)
        if n < k:
            pieces.add_padding(k - n)  # the stream ended: padding rows
        got += n
    pieces.copy_into(batch_groups(local))
    return LocalBatch(local, got, pieces.rows - got)


# Consecutive steps assembled at once where every stream's chunk holds their rows: at most
# this many, and at most this many bytes of batches (``round_steps``).
ROUND_STEPS = 4
ROUND_BYTES = 4 << 20


def round_steps(rows: int, seq_len: int, device_prefetch: int) -> int:
    """How many steps of ``rows`` local rows ``fill_round`` assembles at once: up to
    ``ROUND_STEPS`` while they stay within ``ROUND_BYTES`` and ``device_prefetch``; 1 where
    a field of a batch after the first would not start on a 64-byte boundary (a transfer to
    a CPU device would copy it, ``host_buffers``)."""
    field_bytes = rows * seq_len * 4
    if field_bytes % 64:
        return 1
    return max(1, min(ROUND_STEPS, device_prefetch, ROUND_BYTES // (len(FIELDS) * field_bytes)))


def fill_round(intake: ChunkIntake, rows: HostRows, k: int, seq_len: int,
               steps: int) -> np.ndarray | None:
    """The local batches of the next ``steps`` steps, ``[steps, 6, rows, seq_len]``, where
    every one of ``rows.streams`` has their ``k x steps`` rows in its current chunk (else
    None). The rows are not taken: ``ChunkIntake.advance`` takes each step's.

    One round's copies and hand-offs serve ``steps`` batches, which takes the feed's process
    less CPU a step than step by step."""
    for s in rows.streams:
        if not intake.holds(s, k * steps):
            return None
    out = aligned_empty((steps, len(FIELDS), rows.stop - rows.start, seq_len))
    pieces = RowPieces(seq_len, steps)
    for s in rows.streams:
        intake.add_ahead(s, pieces, k)
    pieces.copy_into(batch_groups(out))
    return out


def assembled_step(local: LocalBatch, sharding: NamedSharding, global_batch_size: int,
                   state: dict[str, Any]) -> AssembledStep:
    """The step of ``local``'s rows, with ``state`` (the host state after it)."""
    seg = local.fields[FIELDS.index("inputs_segmentation")]
    tokens = int(np.count_nonzero(seg))
    return AssembledStep(local.fields, sharding, global_batch_size, state, tokens,
                         local.fields.shape[1], local.padding_rows, seg.size - tokens)
