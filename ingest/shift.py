"""Shifting packed rows into the six int32 fields of the LLM batch convention.

Input: ``tokens``, ``starts``, ``valid`` of shape ``[n, W]`` (see ``ingest.pack``). With the
left shift W = L + 1 and ``targets[t] = tokens[t + 1]`` (the last target comes from the next
row, so no token pair is lost at row boundaries). With the right shift W = L, ``targets`` are
the row's tokens and ``inputs`` are them shifted right with the end-of-document id first::

    left, L=4   tokens |a b E |c  d        right, L=4   tokens |a b E |c
                inputs  a b E  c                        inputs  E a b  E
                targets b E c  d                        targets a b E  c
                in_seg  1 1 1  2                        seg     1 1 1  2
                tgt_seg 1 1 0  2   (E->c crosses documents: no loss unless
                                    predict_across_documents)

Segment ids count segments within a row from 1 (0 is padding); positions restart at 0 at each
segment start and at the row start (a continued document).
"""

from __future__ import annotations

import numpy as np

__all__ = ["FIELDS", "concat_fields", "shift_rows"]

# Sorted by name: the digest and the chunk layout both use this order.
FIELDS = ("inputs", "inputs_position", "inputs_segmentation",
          "targets", "targets_position", "targets_segmentation")


def _segments_and_positions(begin: np.ndarray, seg: np.ndarray, pos: np.ndarray) -> None:
    """Writes segment ids and positions of ``[n, w]`` rows into ``seg`` and ``pos``.

    ``begin`` is True where a segment begins, column 0 included, so a segment never crosses
    a row end. Both are runs over the flat rows: segment j (its first cell ``at[j]``) holds
    its id within its row and the positions ``0, 1, ...`` from ``at[j]``. Repeating each
    segment's id and start over its length took a third of the time of two flat prefix sums.
    """
    n, w = begin.shape
    flat = begin.reshape(-1)
    if not flat.size:
        return
    at = np.flatnonzero(flat)
    lengths = np.diff(at, append=flat.size)
    # The id of segment j within its row: j + 1 minus the index of the row's first segment.
    first = np.where(at % w == 0, np.arange(at.size), 0)
    np.maximum.accumulate(first, out=first)
    ids = (np.arange(1, at.size + 1) - first).astype(np.int32)
    seg[...] = np.repeat(ids, lengths).reshape(n, w)
    np.subtract(np.arange(flat.size, dtype=np.int32).reshape(n, w),
                np.repeat(at.astype(np.int32), lengths).reshape(n, w), out=pos)


def shift_rows(tokens: np.ndarray, starts: np.ndarray, valid: np.ndarray, *, shift: str,
               predict_across_documents: bool, eos_id: int) -> np.ndarray:
    """Builds the six fields.

    Returns:
      int32 array ``[6, n, L]``, fields in ``FIELDS`` order.
    """
    n, w = tokens.shape
    seq_len = w - 1 if shift == "left" else w
    out = np.empty((6, n, seq_len), dtype=np.int32)
    inputs, pos, seg, targets, tpos, tseg = out
    in_valid = valid[:, :seq_len]
    begin = starts[:, :seq_len].copy()
    begin[:, 0] = True
    _segments_and_positions(begin, seg, pos)
    seg *= in_valid
    pos *= in_valid
    tpos[:] = pos
    if shift == "left":
        np.multiply(tokens[:, :seq_len], in_valid, out=inputs)
        has_target = in_valid & valid[:, 1:]
        np.multiply(tokens[:, 1:], has_target, out=targets)
        if not predict_across_documents:
            has_target &= ~starts[:, 1:]
        np.multiply(seg, has_target, out=tseg)
    else:
        np.multiply(tokens, valid, out=targets)
        inputs[:, 0] = eos_id
        inputs[:, 1:] = tokens[:, :-1]
        inputs *= valid
        tseg[:] = seg
    return out


def concat_fields(tokens: np.ndarray, starts: np.ndarray, n_rows: int, seq_len: int, *,
                  shift: str, predict_across_documents: bool, eos_id: int) -> np.ndarray:
    """Packs a flat token sequence with ``concat`` and shifts it, in one pass.

    The same array as ``shift_rows(*concat_rows(tokens, starts, n_rows, seq_len, W), ...)``
    (``ingest.pack``), written straight from the flat sequence: row r holds tokens
    ``[r * seq_len, (r + 1) * seq_len)``, so no ``[n, W]`` copies are needed (4-6 x faster
    for 128 rows of 1024). Tokens missing at the end (finite data) become padding.

    Args:
      tokens: int32 token sequence (documents with EOS, back to back), at least what the rows
        take; more is ignored.
      starts: bool, True at each document's first token (same length as ``tokens``).

    Returns:
      int32 array ``[6, n_rows, seq_len]``, fields in ``FIELDS`` order.
    """
    n, L = n_rows, seq_len
    cells = n * L
    have = min(len(tokens), cells + (1 if shift == "left" else 0))
    real = min(have, cells)  # input cells that hold a token; the rest is padding
    out = np.empty((6, n, L), dtype=np.int32)
    inputs, pos, seg, targets, tpos, tseg = (f.reshape(-1) for f in out)
    begin = np.zeros((n, L), dtype=bool)
    begin.reshape(-1)[:real] = starts[:real]
    begin[:, 0] = True
    _segments_and_positions(begin, out[2], out[1])
    seg[real:] = 0
    pos[real:] = 0
    tpos[:] = pos
    if shift == "left":
        inputs[:real] = tokens[:real]
        inputs[real:] = 0
        m = max(have - 1, 0)  # input cells followed by a token: the ones with a target
        targets[:m] = tokens[1:have]
        targets[m:] = 0
        if predict_across_documents:
            tseg[:m] = seg[:m]
        else:
            # No loss on a target that begins the next document.
            np.multiply(seg[:m], ~starts[1:have], out=tseg[:m], casting="unsafe")
        tseg[m:] = 0
    else:
        targets[:real] = tokens[:real]
        targets[real:] = 0
        rows = inputs.reshape(n, L)
        rows[:, 0] = eos_id
        rows[:, 1:] = targets.reshape(n, L)[:, :-1]
        inputs[real:] = 0
        tseg[:] = seg
    return out
