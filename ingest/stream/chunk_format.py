"""The chunk format: how a chunk keeps the six fields of the LLM batch convention, and how rows
of chunks are copied into a batch.

A batch holds ``FIELDS`` as int32 ``[rows, seq_len]`` arrays. A chunk keeps them as two arrays
that cost fewer bytes in Ray's object store: ``tokens`` (``TOKEN_FIELDS``, int32) and ``layout``
(``LAYOUT_FIELDS`` in ``layout_dtype(seq_len)``); ``targets_position`` is always
``inputs_position``, so it is kept once. ``ingest.stream.shift`` and ``ingest.stream.pack`` write chunks in
this format; ``RowPieces`` copies rows of them into a batch's ``batch_groups``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["FIELDS", "FIELD_PLACES", "LAYOUT_FIELDS", "TOKEN_FIELDS", "RowPieces",
           "batch_groups", "chunk_token_bytes", "fields_of", "layout_dtype", "new_rows"]

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
