"""Shifting packed rows into the six fields of the LLM batch convention, kept as a chunk's
two arrays: ``tokens`` (``TOKEN_FIELDS``, int32) and ``layout`` (``LAYOUT_FIELDS``).

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

import functools

import numpy as np

__all__ = ["FIELDS", "FIELD_PLACES", "LAYOUT_FIELDS", "TOKEN_FIELDS", "RowPieces",
           "batch_groups", "chunk_token_bytes", "concat_fields", "fields_of", "layout_dtype",
           "new_rows", "shift_rows"]

# Sorted by name: the digest and the chunk layout both use this order.
FIELDS = ("inputs", "inputs_position", "inputs_segmentation",
          "targets", "targets_position", "targets_segmentation")

# How a chunk keeps the six fields: ``tokens`` holds TOKEN_FIELDS (int32), ``layout`` holds
# LAYOUT_FIELDS in ``layout_dtype(seq_len)``; targets_position is always inputs_position, so it
# is not kept twice. 14 bytes a token where seq_len < 65536, against 24 for six int32 fields:
# every chunk is copied into Ray's object store by its worker and read out of it by the host.
TOKEN_FIELDS = ("inputs", "targets")
LAYOUT_FIELDS = ("inputs_position", "inputs_segmentation", "targets_segmentation")
# Where each of FIELDS is kept: (0 for tokens or 1 for layout, its index there).
FIELD_PLACES = tuple(
    (0, TOKEN_FIELDS.index(f)) if f in TOKEN_FIELDS
    else (1, LAYOUT_FIELDS.index("inputs_position" if f == "targets_position" else f))
    for f in FIELDS)


def layout_dtype(seq_len: int) -> np.dtype:
    """The dtype of a chunk's positions and segment ids: uint16 where every value fits
    (positions below seq_len, segment ids up to seq_len), else int32."""
    return np.dtype(np.uint16) if seq_len < 1 << 16 else np.dtype(np.int32)


def chunk_token_bytes(seq_len: int) -> int:
    """Bytes a chunk keeps per token (per row and position): its tokens and its layout."""
    return 4 * len(TOKEN_FIELDS) + layout_dtype(seq_len).itemsize * len(LAYOUT_FIELDS)


def batch_groups(out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A batch's int32 ``[6, rows, seq_len]`` array (FIELDS order) as three ``[2, rows,
    seq_len]`` views: the tokens (inputs, targets), the positions and the segment ids, each
    inputs' then targets'. ``RowPieces`` fills each group with one copy. Of ``[steps, 6, rows,
    seq_len]`` (several steps' batches), each view is ``[steps, 2, rows, seq_len]``.

    Raises:
      ValueError: ``out`` is not C-contiguous (its groups would be a copy, not views).
    """
    if not out.flags.c_contiguous:
        raise ValueError(f"batch_groups needs a C-contiguous [6, rows, seq_len] array, got "
                         f"shape {out.shape} with strides {out.strides}")
    # FIELDS: inputs' three fields, then targets' three.
    by_side = out.reshape(*out.shape[:-3], 2, 3, *out.shape[-2:])
    return by_side[..., 0, :, :], by_side[..., 1, :, :], by_side[..., 2, :, :]


class RowPieces:
    """Row ranges of chunks, in a batch's order, copied into it at once.

    ``add`` notes rows of a chunk's ``tokens`` and ``layout``, ``add_padding`` all-zero rows;
    ``copy_into`` writes them back to back into the rows of a batch's ``batch_groups``: one
    copy per group, however many pieces, against three per piece copied on its own. Each numpy
    copy lets the interpreter's lock go, a chance for another thread to take it and make the
    assembling thread wait for it back, so fewer, larger copies keep the step short.

    With ``steps`` > 1, the pieces fill that many consecutive batches at once (``[steps, 6,
    rows, seq_len]``): a piece of n rows a step is ``steps x n`` consecutive rows of its
    chunk, the first n for the first batch, and so on.
    """

    def __init__(self, seq_len: int, steps: int = 1):
        self.seq_len = seq_len
        self.steps = steps
        self.rows = 0  # rows of each batch
        self._tokens: list[np.ndarray] = []
        self._positions: list[np.ndarray] = []
        self._segments: list[np.ndarray] = []

    def add(self, tokens: np.ndarray, layout: np.ndarray, start: int, n: int) -> None:
        """``n`` rows a step of a chunk's ``tokens`` and ``layout``, from row ``start``."""
        stop = start + n * self.steps
        tokens, layout = tokens[:, start:stop], layout[:, start:stop]
        if self.steps > 1:  # [fields, steps x n, L] -> [steps, fields, n, L]
            tokens = tokens.reshape(len(TOKEN_FIELDS), self.steps, n, -1).swapaxes(0, 1)
            layout = layout.reshape(len(LAYOUT_FIELDS), self.steps, n, -1).swapaxes(0, 1)
        self._tokens.append(tokens)
        self._positions.append(layout[..., :1, :, :])
        self._segments.append(layout[..., 1:, :, :])
        self.rows += n

    def add_padding(self, n: int) -> None:
        """``n`` all-zero rows a step (a stream that ended)."""
        tokens, layout = new_rows(n * self.steps, self.seq_len, zeros=True)
        self.add(tokens, layout, 0, n)

    def copy_into(self, groups: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        """Writes the pieces into rows ``[0, self.rows)`` of ``groups`` (``batch_groups``),
        positions and segment ids widened to int32."""
        if not self.rows:
            return
        tok, pos, seg = (g[..., :self.rows, :] for g in groups)
        np.concatenate(self._tokens, axis=-2, out=tok)
        np.concatenate(self._positions, axis=-2, out=pos[..., :1, :, :])
        pos[..., 1, :, :] = pos[..., 0, :, :]  # targets_position is inputs_position
        np.concatenate(self._segments, axis=-2, out=seg)


def fields_of(tokens: np.ndarray, layout: np.ndarray) -> np.ndarray:
    """A chunk's ``tokens`` and ``layout`` arrays as one int32 ``[6, rows, seq_len]`` array,
    fields in ``FIELDS`` order (a new array)."""
    out = np.empty((len(FIELDS), *tokens.shape[1:]), np.int32)
    pieces = RowPieces(tokens.shape[2])
    pieces.add(tokens, layout, 0, tokens.shape[1])
    pieces.copy_into(batch_groups(out))
    return out


def new_rows(n_rows: int, seq_len: int, *, zeros: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Empty (or zeroed) ``tokens`` and ``layout`` arrays of ``n_rows`` rows for a chunk."""
    make = np.zeros if zeros else np.empty
    return (make((len(TOKEN_FIELDS), n_rows, seq_len), np.int32),
            make((len(LAYOUT_FIELDS), n_rows, seq_len), layout_dtype(seq_len)))


@functools.lru_cache(maxsize=8)
def _ramp(size: int, dtype: str) -> np.ndarray:
    """``0, 1, ..., size - 1`` in ``dtype`` (uint16: modulo 65536), read-only."""
    out = np.arange(size, dtype=np.int64).astype(dtype)
    out.flags.writeable = False
    return out


def _segments_and_positions(begin: np.ndarray, seg: np.ndarray, pos: np.ndarray) -> None:
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
    _segments_and_positions(begin, seg, pos)
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


def concat_fields(tokens: np.ndarray, starts: np.ndarray, n_rows: int, seq_len: int, *,
                  shift: str, predict_across_documents: bool,
                  eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Packs a flat token sequence with ``concat`` and shifts it, in one pass.

    The same rows as ``shift_rows(*concat_rows(tokens, starts, n_rows, seq_len, W), ...)``
    (``ingest.pack``), written straight from the flat sequence: row r holds tokens
    ``[r * seq_len, (r + 1) * seq_len)``, so no ``[n, W]`` copies are needed. Tokens missing at the end (finite data) become padding.

    Args:
      tokens: int32 token sequence (documents with EOS, back to back), at least what the rows
        take; more is ignored.
      starts: bool, True at each document's first token (same length as ``tokens``).

    Returns:
      a chunk's ``tokens`` and ``layout`` arrays (``new_rows``) of ``n_rows`` rows.
    """
    n, L = n_rows, seq_len
    cells = n * L
    have = min(len(tokens), cells + (1 if shift == "left" else 0))
    real = min(have, cells)  # input cells that hold a token; the rest is padding
    tok, lay = new_rows(n, L)
    inputs, targets = (f.reshape(-1) for f in tok)
    pos, seg, tseg = (f.reshape(-1) for f in lay)
    begin = np.zeros((n, L), dtype=bool)
    begin.reshape(-1)[:real] = starts[:real]
    begin[:, 0] = True
    _segments_and_positions(begin, lay[1], lay[0])
    seg[real:] = 0
    pos[real:] = 0
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
    return tok, lay
