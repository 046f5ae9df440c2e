"""Packing: laying document tokens out in rows of ``seq_len``.

Every packer returns rows as three ``[n, W]`` arrays: ``tokens`` (int32), ``starts`` (True where
a segment begins) and ``valid`` (False on padding). ``W = seq_len + 1`` for the left shift, whose
last column is the next row's first token (the target of the last input), else ``seq_len``.

``concat`` cuts the stream's token sequence into windows (documents end with EOS, ``|`` marks
a document start, L=4, left shift)::

    tokens   |a b c E |d e E |f g h i j E ...
    row 0    a b c E d        (inputs a b c E, targets b c E d)
    row 1    d e E f g        (d continues: position restarts at 0, no start mark)

``first_fit``/``best_fit`` follow grain's ``FirstFitPackIterDataset``/``BestFitPackIterDataset``
(``shuffle_bins=False``): pieces (documents, or row-sized parts of long ones) go into
``num_bins`` open bins until one fits nowhere; then all bins are emitted as rows and packing
restarts with that piece. First fit takes the first bin with room; best fit the fullest bin
with room (ties: the first)::

    pieces 3 2 4 1 3 2   L=5, 2 bins
    first_fit  bin0: 3 2   bin1: 4 1   -> piece 3 fits nowhere: emit [3 2][4 1], restart
"""

from __future__ import annotations

import numpy as np

from ingest.stream.chunk_format import new_rows
from ingest.stream.shift import segments_and_positions

__all__ = ["BinPacker", "assign_bins", "concat_fields", "concat_rows", "fill_bins"]


def concat_rows(tokens: np.ndarray, starts: np.ndarray, n_rows: int, seq_len: int,
                width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cuts ``n_rows`` windows of ``width`` tokens, ``seq_len`` apart, from a flat sequence.

    Tokens missing at the end (finite data) become padding (``valid`` False).
    """
    need = (n_rows - 1) * seq_len + width
    have = min(len(tokens), need)
    tok = np.zeros(need, dtype=np.int32)
    st = np.zeros(need, dtype=bool)
    tok[:have] = tokens[:have]
    st[:have] = starts[:have]
    valid = np.zeros(need, dtype=bool)
    valid[:have] = True
    idx = np.arange(n_rows)[:, None] * seq_len + np.arange(width)[None, :]
    return tok[idx], st[idx], valid[idx]


class BinPacker:
    """``assign_bins`` one piece at a time, so a caller can make pieces only until one fits
    nowhere (the cost of a packing batch stays linear in the pieces it places).

    Args:
      capacity: tokens per bin (row).
      num_bins: open bins (grain's ``num_packing_bins``).
      best_fit: fullest fitting bin instead of the first fitting bin.
    """

    def __init__(self, capacity: int, num_bins: int, best_fit: bool):
        self.capacity = capacity
        self.best_fit = best_fit
        self.placed = 0
        self._used = np.zeros(num_bins, dtype=np.int64)
        self._bins: list[list[int]] = [[] for _ in range(num_bins)]

    def place(self, length: int) -> bool:
        """Places the next piece (index ``placed``), of ``length`` <= capacity tokens.

        Returns:
          False, placing nothing, when it fits in no bin: the batch is complete.
        """
        fits = self._used + length <= self.capacity
        if not fits.any():
            return False
        if self.best_fit:
            b = int(np.argmax(np.where(fits, self._used, -1)))
        else:
            b = int(np.argmax(fits))
        self._used[b] += length
        self._bins[b].append(self.placed)
        self.placed += 1
        return True

    def bins(self) -> list[list[int]]:
        """Piece indices per non-empty bin, in bin order."""
        return [b for b in self._bins if b]


def assign_bins(lengths: np.ndarray, capacity: int, num_bins: int, best_fit: bool) -> tuple[
        list[list[int]], int]:
    """Packs pieces, in order, into at most ``num_bins`` bins until one fits nowhere.

    Args:
      lengths: piece lengths, each <= capacity.
      capacity: tokens per bin (row).
      num_bins: open bins (grain's ``num_packing_bins``).
      best_fit: fullest fitting bin instead of the first fitting bin.

    Returns:
      (bins, consumed): piece indices per non-empty bin, and how many leading pieces were
      placed (the rest start the next packing batch).
    """
    packer = BinPacker(capacity, num_bins, best_fit)
    for n in lengths.tolist():
        if not packer.place(n):
            break
    return packer.bins(), packer.placed


def fill_bins(pieces: list[np.ndarray], bins: list[list[int]], width: int) -> tuple[
        np.ndarray, np.ndarray, np.ndarray]:
    """Lays each bin's pieces out in one row; every piece starts a segment."""
    n = len(bins)
    tok = np.zeros((n, width), dtype=np.int32)
    st = np.zeros((n, width), dtype=bool)
    valid = np.zeros((n, width), dtype=bool)
    for r, b in enumerate(bins):
        at = 0
        for i in b:
            p = pieces[i]
            tok[r, at:at + len(p)] = p
            st[r, at] = True
            at += len(p)
        valid[r, :at] = True
    return tok, st, valid


def concat_fields(tokens: np.ndarray, starts: np.ndarray, n_rows: int, seq_len: int, *,
                  shift: str, predict_across_documents: bool,
                  eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Packs a flat token sequence with ``concat`` and shifts it, in one pass.

    The same rows as ``shift_rows(*concat_rows(tokens, starts, n_rows, seq_len, W), ...)``
    (``ingest.stream.pack``), written straight from the flat sequence: row r holds tokens
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
    segments_and_positions(begin, lay[1], lay[0])
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
