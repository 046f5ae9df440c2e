"""Shifting packed rows into the six fields of the LLM batch convention, kept as a chunk's
two arrays: ``tokens`` (``TOKEN_FIELDS``, int32) and ``layout`` (``LAYOUT_FIELDS``).

Input: ``tokens``, ``starts``, ``valid`` of shape ``[n, W]`` (see ``ingest.stream.pack``). With the
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
segment start and at the row start (a continued document). The rows come in a chunk's format
(``ingest.stream.chunk_format``); ``ingest.stream.pack.concat_fields`` packs and shifts in one pass.
"""

from __future__ import annotations

import functools

import numpy as np

from ingest.stream.chunk_format import new_rows

__all__ = ["segments_and_positions", "shift_rows"]


@functools.lru_cache(maxsize=8)
def _ramp(size: int, dtype: str) -> np.ndarray:
    """``0, 1, ..., size - 1`` in ``dtype`` (uint16: modulo 65536), read-only."""
    out = np.arange(size, dtype=np.int64).astype(dtype)
    out.flags.writeable = False
    return out


def segments_and_positions(begin: np.ndarray, seg: np.ndarray, pos: np.ndarray) -> None:
    """Writes segment ids and positions of ``[n, w]`` rows into ``seg`` and ``pos`` (of one
    ``layout_dtype``).

    ``begin`` is True where a segment begins, column 0 included, so a segment never crosses
    a row end. Both are runs over the flat rows: segment j (its first cell ``at[j]``) holds
    its id within its row and the positions ``0, 1, ...`` from ``at[j]``. Repeating each
    segment's id and start over its length took a third of the time of two flat prefix sums.
    A position is the cell's flat index less its segment's first: in uint16 both are taken
    modulo 65536, which leaves the difference (below seq_len) exact.
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
    ids = (np.arange(1, at.size + 1) - first).astype(seg.dtype)
    seg[...] = np.repeat(ids, lengths).reshape(n, w)
    np.subtract(_ramp(flat.size, pos.dtype.str).reshape(n, w),
                np.repeat(at.astype(pos.dtype), lengths).reshape(n, w), out=pos)


def shift_rows(tokens: np.ndarray, starts: np.ndarray, valid: np.ndarray, *, shift: str,
               predict_across_documents: bool, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Builds the six fields.

    Returns:
      a chunk's ``tokens`` and ``layout`` arrays (``new_rows``) of ``n`` rows.
    """
    n, w = tokens.shape
    seq_len = w - 1 if shift == "left" else w
    tok, lay = new_rows(n, seq_len)
    inputs, targets = tok
    pos, seg, tseg = lay
    in_valid = valid[:, :seq_len]
    begin = starts[:, :seq_len].copy()
    begin[:, 0] = True
    segments_and_positions(begin, seg, pos)
    seg *= in_valid
    pos *= in_valid
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
    return tok, lay
