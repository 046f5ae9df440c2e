"""The plan of an evaluation: tokenized sequences sorted by length, longest first, and cut
into global batches of ``global_batch_size`` consecutive sequences (see ``ingest.evaluation.requests``
for the requests, the sequences and a drawing of the batches).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ingest.evaluation.requests import INDEX_FIELDS, EvalConfig, EvalSequences
from ingest.stream.chunk_format import FIELDS

__all__ = ["EvalPlan", "plan_batches"]


@dataclasses.dataclass(frozen=True, eq=False)
class EvalPlan:
    """Global batches: batch b holds sorted sequences ``[b*B, (b+1)*B)`` (the last one padded
    with empty rows), ``widths[b]`` tokens wide.

    Attributes:
      sequences: the tokenized requests.
      order: ``sequences`` indices in batch order (sorted longest first, or request order).
      widths: int ``[num_batches]``: each batch's width.
      global_batch_size: B.
      padding_multiple: widths are multiples of this.
    """

    sequences: EvalSequences
    order: np.ndarray
    widths: np.ndarray
    global_batch_size: int
    padding_multiple: int

    @property
    def num_batches(self) -> int:
        return len(self.widths)

    def rows(self, batch: int, start: int, stop: int) -> dict[str, np.ndarray]:
        """Rows ``[start, stop)`` of global batch ``batch``: the six ``FIELDS``, int32
        ``[stop - start, width]``, and ``INDEX_FIELDS``, int32 ``[stop - start]`` (-1 on empty
        rows)."""
        if not 0 <= batch < self.num_batches:
            raise IndexError(f"batch={batch} is not in [0, {self.num_batches})")
        width = int(self.widths[batch])
        n = stop - start
        out = {name: np.zeros((n, width), np.int32) for name in FIELDS}
        out.update({name: np.full(n, -1, np.int32) for name in INDEX_FIELDS})
        first = batch * self.global_batch_size
        for r in range(n):
            k = first + start + r
            if k >= len(self.order):
                break
            s = self.sequences.sequences[self.order[k]]
            m = s.length
            out["inputs"][r, :m] = s.tokens[:-1]
            out["targets"][r, :m] = s.tokens[1:]
            out["inputs_position"][r, :m] = np.arange(m, dtype=np.int32)
            out["targets_position"][r, :m] = out["inputs_position"][r, :m]
            out["inputs_segmentation"][r, :m] = 1
            out["targets_segmentation"][r, s.loss_start:m] = 1
            out["document_idx"][r] = s.document_idx
            out["sequence_idx"][r] = s.sequence_idx
        return out

    def stats(self) -> dict[str, Any]:
        """Counts over every global batch (the same on every host).

        ``padding_fraction`` is padding tokens / all tokens of the batches (rows x width);
        ``unsorted_padding_fraction`` is the same for batches in request order, as a
        comparison. ``widths``: the distinct batch widths (one compilation each).
        """
        seqs = self.sequences.sequences
        lengths = np.array([s.length for s in seqs], np.int64)
        total = int(self.widths.sum()) * self.global_batch_size
        tokens = int(lengths.sum())
        unsorted = _widths(lengths, self.global_batch_size, self.padding_multiple)
        unsorted_total = int(unsorted.sum()) * self.global_batch_size
        return {
            "requests": self.sequences.num_requests,
            "rows": len(seqs),
            "padding_rows": self.num_batches * self.global_batch_size - len(seqs),
            "batches": self.num_batches,
            "tokens": tokens,
            "loss_tokens": int(sum(s.length - s.loss_start for s in seqs)),
            "padding_tokens": total - tokens,
            "padding_fraction": (total - tokens) / total if total else 0.0,
            "unsorted_padding_fraction": ((unsorted_total - tokens) / unsorted_total
                                          if unsorted_total else 0.0),
            "truncated_prefixes": self.sequences.truncated_prefixes,
            "truncated_prefix_tokens": self.sequences.truncated_prefix_tokens,
            "widths": sorted({int(w) for w in self.widths}),
        }


def _widths(lengths: np.ndarray, batch_size: int, multiple: int) -> np.ndarray:
    """Each batch's longest length (in the given order) rounded up to ``multiple``."""
    if len(lengths) == 0:
        return np.zeros(0, np.int64)
    n = -(-len(lengths) // batch_size)
    padded = np.zeros(n * batch_size, np.int64)
    padded[:len(lengths)] = lengths
    longest = padded.reshape(n, batch_size).max(axis=1)
    return -(-longest // multiple) * multiple


def plan_batches(sequences: EvalSequences, config: EvalConfig) -> EvalPlan:
    """Sorts the sequences (if ``config.sort_by_length``) and cuts them into global batches.

    The order is a pure function of the sequences: longest first, ties by request index, then
    sequence index (a stable sort of the request-ordered list).
    """
    seqs = sequences.sequences
    lengths = np.array([s.length for s in seqs], np.int64)
    if config.sort_by_length:
        order = np.argsort(-lengths, kind="stable")
    else:
        order = np.arange(len(seqs))
    widths = _widths(lengths[order], config.global_batch_size, config.padding_multiple)
    return EvalPlan(sequences, order, widths, config.global_batch_size, config.padding_multiple)
