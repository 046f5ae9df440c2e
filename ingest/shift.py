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

__all__ = ["FIELDS", "shift_rows"]

# Sorted by name: the digest and the chunk layout both use this order.
FIELDS = ("inputs", "inputs_position", "inputs_segmentation",
          "targets", "targets_position", "targets_segmentation")


def _segments_and_positions(starts: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray,
                                                                               np.ndarray]:
    n, w = starts.shape
    begin = starts.copy()
    begin[:, 0] = True
    seg = np.cumsum(begin, axis=1, dtype=np.int32)
    seg *= valid
    cols = np.broadcast_to(np.arange(w, dtype=np.int32), (n, w))
    last_begin = np.maximum.accumulate(np.where(begin, cols, 0), axis=1)
    pos = (cols - last_begin) * valid
    return seg.astype(np.int32), pos.astype(np.int32)


def shift_rows(tokens: np.ndarray, starts: np.ndarray, valid: np.ndarray, *, shift: str,
               predict_across_documents: bool, eos_id: int) -> np.ndarray:
    """Builds the six fields.

    Returns:
      int32 array ``[6, n, L]``, fields in ``FIELDS`` order.
    """
    n, w = tokens.shape
    if shift == "left":
        seq_len = w - 1
        seg, pos = _segments_and_positions(starts[:, :seq_len], valid[:, :seq_len])
        inputs = tokens[:, :seq_len] * valid[:, :seq_len]
        has_target = valid[:, :seq_len] & valid[:, 1:]
        if not predict_across_documents:
            has_target &= ~starts[:, 1:]
        targets = tokens[:, 1:] * (valid[:, :seq_len] & valid[:, 1:])
        tseg = seg * has_target
    else:
        seq_len = w
        seg, pos = _segments_and_positions(starts, valid)
        targets = tokens * valid
        inputs = np.empty_like(tokens)
        inputs[:, 0] = eos_id
        inputs[:, 1:] = tokens[:, :-1]
        inputs *= valid
        tseg = seg
    out = np.empty((6, n, seq_len), dtype=np.int32)
    out[0] = inputs
    out[1] = pos
    out[2] = seg
    out[3] = targets
    out[4] = pos
    out[5] = tseg
    return out
