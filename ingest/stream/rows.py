"""A text stream's rows: the tokens from the head on, cut into rows (``packing: concat``) or
packed into bins of whole documents (``first_fit``, ``best_fit``, ``none``), then shifted into
the six fields (a chunk's ``tokens`` and ``layout`` arrays, ``ingest.stream.chunk_format``).

With first_fit/best_fit the head stays at the first piece of the packing batch being emitted,
and ``batch_rows_taken`` in the state counts the batch's rows already emitted: restore re-packs
that batch and skips them.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ingest.config import Config
from ingest.stream.chunk_format import new_rows
from ingest.stream.head import Head
from ingest.stream.pack import BinPacker, concat_fields, fill_bins
from ingest.stream.shift import shift_rows
from ingest.stream.unit_reader import UnitTokens

__all__ = ["RowBuilder"]


class RowBuilder:
    """Makes a stream's rows from its head, moving the head past them; keeps the packing batch
    being emitted (``reset`` drops it, when the head moves otherwise)."""

    def __init__(self, config: Config, eos_id: int):
        self.config = config
        self.eos_id = eos_id
        self.reset()

    def reset(self) -> None:
        self._batch: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._batch_next: tuple[int, int, int] | None = None

    def produce(self, head: Head,
                n_rows: int) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
        """The next ``n_rows`` rows from ``head`` (fewer only when the data ends): a chunk's
        ``(tokens, layout)`` arrays and the ``documents`` counter after each row."""
        c = self.config
        if c.packing == "concat":
            return self._produce_concat(head, n_rows)
        *rows, documents = self._produce_bins(head, n_rows)
        fields = shift_rows(*rows, shift=c.shift,
                            predict_across_documents=c.predict_across_documents,
                            eos_id=self.eos_id)
        return fields, documents

    def _width(self) -> int:
        return self.config.seq_len + (1 if self.config.shift == "left" else 0)

    def _empty(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        w = self._width()
        return (np.zeros((0, w), np.int32), np.zeros((0, w), bool), np.zeros((0, w), bool),
                np.zeros(0, np.int64))

    def _no_fields(self) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
        return new_rows(0, self.config.seq_len), np.zeros(0, np.int64)

    def _produce_concat(self, head: Head,
                        n_rows: int) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
        c = self.config
        L = c.seq_len
        width = self._width()
        first = head.unit()
        if first is None:
            return self._no_fields()
        need = (n_rows - 1) * L + width
        at = head.token()
        parts_t, parts_s = [first.tokens[at:]], [first.starts[at:]]
        have = len(parts_t[0])
        i = 0
        while have < need:
            u = head.unit_after(i + 1)
            if u is None:
                break
            i += 1
            parts_t.append(u.tokens)
            parts_s.append(u.starts)
            have += len(u.tokens)
        flat_t = np.concatenate(parts_t) if len(parts_t) > 1 else parts_t[0]
        flat_s = np.concatenate(parts_s) if len(parts_s) > 1 else parts_s[0]
        rows = min(n_rows, -(-have // L)) if have < need else n_rows
        if rows == 0:
            head.advance(len(head.loaded), None)
            return self._no_fields()
        fields = concat_fields(flat_t, flat_s, rows, L, shift=c.shift,
                               predict_across_documents=c.predict_across_documents,
                               eos_id=self.eos_id)
        documents = self._documents_by_row(head, at, i + 1, rows)
        # Move the head to token rows*L past it; rows only run short when the data ended.
        target = at + rows * L
        k = 0
        while k < len(head.loaded) - 1 and target >= len(head.loaded[k].tokens):
            target -= len(head.loaded[k].tokens)
            k += 1
        if have < need and target >= len(head.loaded[k].tokens):
            head.advance(len(head.loaded), None)
        else:
            head.advance(k, target)
        return fields, documents

    def _documents_by_row(self, head: Head, at: int, n_units: int, rows: int) -> np.ndarray:
        """The ``documents`` counter after each of ``rows`` rows read from token ``at`` of the
        head unit on, over the first ``n_units`` loaded units: the head passes a document once
        the rows reach its end (as ``_advance`` counts)."""
        L = self.config.seq_len
        ends, start = [], -at
        for k in range(n_units):
            u = head.loaded[k]
            first = head.state.doc - u.first_doc if k == 0 else 0
            good = u.bad[first:] == 0
            ends.append(u.doc_offsets[first + 1:][good] + start)
            start += len(u.tokens)
        ends = np.concatenate(ends) if len(ends) > 1 else ends[0]
        passed = np.searchsorted(ends, np.arange(1, rows + 1, dtype=np.int64) * L, "right")
        return passed + head.state.documents

    def _pieces(self, head: Head, first: UnitTokens, rel_doc: int, offset: int
                ) -> Iterator[tuple[np.ndarray, tuple[int, int, int]]]:
        """Pieces from (rel_doc, offset) of the head unit on, each with the head it starts at
        (loaded index, rel doc, offset). Lazy: a unit after the head's is read only once every
        piece before it has been asked for."""
        L = self.config.seq_len
        split = self.config.long_documents == "split"
        i, u = 0, first
        while u is not None:
            for d in range(rel_doc, len(u.bad)):
                a, b = int(u.doc_offsets[d]), int(u.doc_offsets[d + 1])
                if a == b:
                    continue
                if not split:
                    yield u.tokens[a:a + min(L, b - a)], (i, d, 0)
                    continue
                off = offset if d == rel_doc else 0
                for p in range(a + off, b, L):
                    yield u.tokens[p:min(p + L, b)], (i, d, p - a)
            i, rel_doc, offset = i + 1, 0, 0
            u = head.unit_after(i)

    def _build_batch(self, head: Head) -> None:
        """Packs the batch that starts at the head; remembers where the next one starts.

        Pieces are made only until one fits nowhere (``none``: until the second), so a
        batch costs what it places, however long the unit's remaining documents are."""
        c = self.config
        first = head.unit()
        if first is None:
            self._batch = self._empty()
            self._batch_next = None
            return
        s = head.state
        packer = (None if c.packing == "none"
                  else BinPacker(c.seq_len, c.packing_bins, c.packing == "best_fit"))
        pieces: list[np.ndarray] = []
        self._batch_next = None  # None: the data ends inside this batch
        for piece, at in self._pieces(head, first, s.doc - first.first_doc, s.offset):
            full = bool(pieces) if packer is None else not packer.place(len(piece))
            if full:  # this piece starts the next batch
                self._batch_next = at
                break
            pieces.append(piece)
        bins = ([[0]] if pieces else []) if packer is None else packer.bins()
        self._batch = fill_bins(pieces, bins, self._width())

    def _produce_bins(self, head: Head, n_rows: int):
        out = []
        got = 0
        s = head.state
        while got < n_rows and not s.exhausted:
            if self._batch is None:
                self._build_batch(head)
            nb = len(self._batch[0])
            take = min(n_rows - got, nb - s.batch_rows_taken)
            if take > 0:
                a = s.batch_rows_taken
                # The head moves once the batch's last row is taken (below).
                out.append((*(x[a:a + take] for x in self._batch),
                            np.full(take, s.documents, np.int64)))
                got += take
                s.batch_rows_taken += take
            if s.batch_rows_taken >= nb:
                nxt = self._batch_next
                self._batch = None
                s.batch_rows_taken = 0
                if nxt is None:
                    head.advance(len(head.loaded), None)
                else:
                    k, rel, off = nxt
                    base = head.loaded[k]
                    head.advance(k, int(base.doc_offsets[rel]) + off)
                if take > 0:
                    out[-1][3][-1] = s.documents
        if not out:
            return self._empty()
        return tuple(np.concatenate([o[j] for o in out]) for j in range(4))
