"""A stream: a deterministic, resumable pipeline over its units, producing chunks of rows.

read rows -> tokenize -> pack -> shift. A stream's position is a *head*: (epoch, unit, doc,
offset) names the next token not yet emitted. Everything else (tokens of the head's unit,
later units already read, a packing batch being emitted) is a cache the head rebuilds by
re-reading and re-tokenizing, which is deterministic. So the state stays small:

    state = {epoch, unit, doc, offset, batch_rows_taken, rows_emitted, exhausted, counters}

``batch_rows_taken`` serves first_fit/best_fit: their head stays at the first piece of the
packing batch being emitted, and restore re-packs that batch and skips the rows taken.
Counters (documents, skips, truncations) advance with the head, so they survive resume exactly.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter, OrderedDict
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ingest.config import Config
from ingest.errors import BadInputError, StreamError
from ingest.pack import assign_bins, fill_bins
from ingest.plan import UnitPlan, deal_units, philox
from ingest.shift import FIELDS, concat_fields, shift_rows
from ingest.sources import BAD_REASONS, decode_texts, numpy_view, read_texts
from ingest.tokenize import Tokenizer, docs_of, load_tokenizer, with_eos

__all__ = ["Chunk", "Stream", "StreamState", "open_stream"]

STATE_VERSION = 1


@dataclasses.dataclass
class StreamState:
    """Where a stream is, and what it has counted; JSON at the boundary only.

    Attributes:
      epoch, unit, doc, offset: the head: epoch, index into this stream's units of that epoch,
        document in the unit's reading order (skipped ones count), token in that document
        (its tokens followed by EOS).
      batch_rows_taken: first_fit/best_fit: rows already emitted of the packing batch that
        starts at the head.
      rows_emitted: rows produced so far.
      exhausted: no rows are left (finite num_epochs).
      documents: documents the head has passed.
      skipped: bad documents skipped, ``{reason: {path: count}}``.
      skipped_units: units skipped as unreadable, ``{path: rows}``.
      truncated_documents, truncated_tokens: cut by ``long_documents: truncate``.
      poison: ``[epoch, unit, doc]`` of documents located as killing their worker, skipped
        (``on_bad_document: skip``) and counted as ``worker_crash``.
    """

    epoch: int = 0
    unit: int = 0
    doc: int = 0
    offset: int = 0
    batch_rows_taken: int = 0
    rows_emitted: int = 0
    exhausted: bool = False
    documents: int = 0
    skipped: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    skipped_units: dict[str, int] = dataclasses.field(default_factory=dict)
    truncated_documents: int = 0
    truncated_tokens: int = 0
    poison: list[list[int]] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["version"] = STATE_VERSION
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StreamState:
        d = dict(d)
        v = d.pop("version", None)
        if v != STATE_VERSION:
            raise ValueError(f"stream state version {v!r} is not supported (expected "
                             f"{STATE_VERSION}); it was written by another ingest version")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"stream state has unknown keys {sorted(unknown)}")
        return cls(**d)


@dataclasses.dataclass
class Chunk:
    """Consecutive rows of one stream, with the stream's state after the last of them.

    Attributes:
      stream_id: the stream.
      fields: int32 ``[6, num_rows, seq_len]`` in ``FIELDS`` order.
      state_after: ``StreamState.to_json()`` after the last row.
      exhausted: the stream has no rows after these (fewer than asked may have come).
      documents: int64 ``[num_rows]``: the state's ``documents`` counter as it reads after
        each row (the state itself is saved at chunk ends only); None where not counted.
    """

    stream_id: int
    fields: np.ndarray
    state_after: dict[str, Any]
    exhausted: bool
    documents: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return self.fields.shape[1]


@dataclasses.dataclass
class _UnitTokens:
    """One unit, tokenized from document ``first_doc`` on."""

    epoch: int
    pos: int  # index into the stream's units of the epoch
    first_doc: int
    tokens: np.ndarray  # int32, documents (with EOS) back to back; skipped ones are empty
    starts: np.ndarray  # bool, True at each document's first token
    doc_offsets: np.ndarray  # int64 [ndocs - first_doc + 1] into tokens
    bad: np.ndarray  # int8 reason code per document (0 = good)
    path: str
    skipped_rows: int = 0  # the whole unit was unreadable and skipped


class Stream:
    """The stream ``stream_id`` of ``num_streams`` over a plan.

    Iterating is ``produce(n)``; ``get_state``/``set_state`` save and restore its head exactly.
    """

    def __init__(self, config: Config, plan: UnitPlan, stream_id: int,
                 tokenizer: Tokenizer | None = None, *, source: int | None = None):
        if not 0 <= stream_id < config.num_streams:
            raise ValueError(f"stream_id={stream_id} outside [0, num_streams={config.num_streams})")
        self.config = config
        self.plan = plan
        self.stream_id = stream_id
        self.source = source  # None: every source's units, pooled; else one mixture component
        self._trace = None
        self._tokenizer_error = ""
        self.tokenizer = tokenizer or load_tokenizer(config.tokenizer, config.tokenizer_backend)
        self._deals: dict[int, np.ndarray] = {}
        self.set_state(StreamState().to_json())

    # -- state ---------------------------------------------------------------------------

    def get_state(self) -> dict[str, Any]:
        return self._state.to_json()

    def set_state(self, state: dict[str, Any]) -> None:
        self._state = StreamState.from_json(state)
        self._loaded: list[_UnitTokens] = []  # head unit first, then read-ahead
        self._batch: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._batch_next: tuple[int, int, int, int] | None = None

    # -- reading units -------------------------------------------------------------------

    def _units(self, epoch: int) -> np.ndarray:
        if epoch not in self._deals:
            c = self.config
            self._deals = {epoch: _dealt(self.plan, num_streams=c.num_streams, seed=c.seed,
                                         epoch=epoch, shuffle=c.shuffle, source=self.source,
                                         deal=c.deal)[self.stream_id]}
        return self._deals[epoch]

    def _next_pos(self, epoch: int, pos: int) -> tuple[int, int] | None:
        """The (epoch, unit position) after ``pos``, or None at the end of finite data."""
        pos += 1
        if pos >= len(self._units(epoch)):
            epoch, pos = epoch + 1, 0
            if self.config.num_epochs is not None and epoch >= self.config.num_epochs:
                return None
        return epoch, pos

    def _read_unit(self, epoch: int, pos: int, first_doc: int) -> _UnitTokens:
        c = self.config
        uid = int(self._units(epoch)[pos])
        unit = self.plan.units[uid]
        info = self.plan.files[unit.file]
        try:
            arr, pre_bad = read_texts(info, unit.group, unit.row_start, unit.row_end,
                                      self.plan.text_columns[unit.source],
                                      sequential=c.deal == "row_groups")
        except BadInputError as e:
            if c.on_bad_file != "skip" or e.reason != "corrupt_file":
                raise
            # Counted once, when the head leaves the unit (see _count).
            return _UnitTokens(epoch, pos, first_doc, np.zeros(0, np.int32), np.zeros(0, bool),
                               np.zeros(1, np.int64), np.zeros(0, np.int8), info.path,
                               skipped_rows=unit.num_rows - first_doc)
        order = np.arange(unit.num_rows)
        if c.shuffle:
            order = philox(c.seed, epoch, uid, 0xD0C).permutation(unit.num_rows)
        order = order[first_doc:]
        arr = arr.take(_int64_array(order))
        pretokenized = bool(self.plan.pretokenized and self.plan.pretokenized[unit.source])
        if pretokenized:
            texts, bad = None, self._check_ids(arr)
        else:
            texts, bad = decode_texts(arr)
        if pre_bad is not None:
            pre = pre_bad[order]
            bad = np.where(pre != 0, pre, bad)
        for e, p, d in self._state.poison:
            # Documents located as killing their worker (actors.pool), skipped by config.
            if (e, p) == (epoch, pos) and d >= first_doc:
                bad[d - first_doc] = BAD_REASONS.index("worker_crash")
        self._raise_first_bad(bad, info, unit, order)
        good_idx = np.flatnonzero(bad == 0)
        if pretokenized:
            good_arr = arr.take(_int64_array(good_idx))
            tokens, eos_at = with_eos(numpy_view(pc.list_flatten(good_arr)),
                                      numpy_view(pc.list_value_length(good_arr)),
                                      self.tokenizer.eos_id)
        else:
            good = texts if len(good_idx) == len(bad) else [texts[i] for i in good_idx.tolist()]
            tokens, eos_at, failed = self._encode(good, epoch, pos, first_doc + good_idx)
            if failed:
                bad[good_idx[failed]] = BAD_REASONS.index("tokenizer_error")
                self._raise_first_bad(bad, info, unit, order, detail=self._tokenizer_error)
        # The good documents' tokens (each with its EOS) are back to back; a bad one has none.
        offsets = np.zeros(len(bad) + 1, dtype=np.int64)
        offsets[1:][bad == 0] = eos_at + 1
        np.maximum.accumulate(offsets, out=offsets)
        starts = np.zeros(len(tokens), dtype=bool)
        starts[offsets[:-1][bad == 0]] = True
        return _UnitTokens(epoch, pos, first_doc, tokens, starts, offsets, bad, info.path)

    def _encode(self, texts: list[str], epoch: int, pos: int, docs: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Token ids of ``texts`` (documents ``docs`` of unit ``pos``), each followed by EOS,
        back to back; the index of each EOS; and the indices of the texts the tokenizer
        failed on (left out of both).

        One call for all normally; one document at a time when the batch fails (to find which)
        or while traced (``set_trace``: the trace names each document before it is tokenized,
        so a document that kills the process is known afterwards).
        """
        out = None
        if self._trace is None:
            try:
                docs_call = getattr(self.tokenizer, "encode_docs", None)
                if docs_call is not None:
                    return (*docs_call(texts), [])
                out, failed = self.tokenizer.encode_batch(texts), []
            except BaseException as e:  # noqa: BLE001 -- tokenizers panic with BaseException
                if isinstance(e, KeyboardInterrupt | SystemExit | GeneratorExit):
                    raise
        if out is None:
            out, failed = self._encode_one_by_one(texts, epoch, pos, docs)
        return (*docs_of(out, self.tokenizer.eos_id), failed)

    def _encode_one_by_one(self, texts: list[str], epoch: int, pos: int, docs: np.ndarray
                           ) -> tuple[list[np.ndarray], list[int]]:
        out: list[np.ndarray] = []
        failed = []
        for i, (t, d) in enumerate(zip(texts, docs.tolist(), strict=True)):
            if self._trace is not None:
                self._trace({"source": self.source, "epoch": epoch, "unit": pos, "doc": d})
            try:
                out.append(self.tokenizer.encode_batch([t])[0])
            except BaseException as e:  # noqa: BLE001
                if isinstance(e, KeyboardInterrupt | SystemExit | GeneratorExit):
                    raise
                self._tokenizer_error = f"{type(e).__name__}: {e}"
                failed.append(i)
        return out, failed

    def set_trace(self, trace) -> None:
        """Calls ``trace(where)`` before tokenizing each document (None: stop); ``where`` is
        what ``add_poison`` takes. Slow: for locating a document that kills its worker."""
        self._trace = trace

    def add_poison(self, where: dict[str, Any]) -> None:
        """Marks the document ``where`` (from a trace) to be skipped as ``worker_crash``."""
        entry = [int(where["epoch"]), int(where["unit"]), int(where["doc"])]
        if entry not in self._state.poison:
            self._state.poison.append(entry)
        self._loaded.clear()
        self._batch = self._batch_next = None

    def _raise_first_bad(self, bad: np.ndarray, info, unit, order: np.ndarray,
                         detail: str | None = None) -> None:
        """Under ``on_bad_document: error``, raises for the first bad document, naming it."""
        if not bad.any() or self.config.on_bad_document != "error":
            return
        i = int(np.flatnonzero(bad)[0])
        row = sum(info.row_groups[:unit.group]) + unit.row_start + int(order[i])
        reason = BAD_REASONS[bad[i]]
        raise BadInputError(
            f"{info.path}: row {row} (in row group {unit.group}), column "
            f"{self.plan.text_columns[unit.source]!r}: {reason.replace('_', ' ')}"
            + (f" ({detail})" if detail else "") + "; fix the data or set on_bad_document: "
            "skip to skip such documents (counted)", reason=reason, path=info.path, row=row)

    def _check_ids(self, arr: pa.Array) -> np.ndarray:
        """Reason codes for a unit of token-id lists: null, empty, or an id outside the
        tokenizer's vocabulary."""
        n = len(arr)
        lengths = np.where(numpy_view(arr.is_null()), -1,
                           numpy_view(pc.list_value_length(arr), nulls_ok=True))
        bad = np.where(lengths < 0, BAD_REASONS.index("null_text"),
                       np.where(lengths == 0, BAD_REASONS.index("empty_text"), 0)).astype(np.int8)
        if n and (lengths > 0).any():
            ids = numpy_view(pc.list_flatten(arr))
            out = (ids < 0) | (ids >= self.tokenizer.vocab_size)
            if out.any():
                # The document of each out-of-range id: flatten skips null and empty lists.
                doc_of = np.repeat(np.arange(n), np.maximum(lengths, 0))
                bad[np.unique(doc_of[out])] = BAD_REASONS.index("invalid_token_id")
        return bad

    def describe_head(self) -> str:
        """Where the head is, in the corpus's terms: ``FILE row N (unit U of epoch E)``."""
        st = self._state
        if st.exhausted:
            return "the end of its data"
        c = self.config
        uid = int(self._units(st.epoch)[st.unit])
        unit = self.plan.units[uid]
        info = self.plan.files[unit.file]
        order = np.arange(unit.num_rows)
        if c.shuffle:
            order = philox(c.seed, st.epoch, uid, 0xD0C).permutation(unit.num_rows)
        doc = min(st.doc, unit.num_rows - 1)
        row = sum(info.row_groups[:unit.group]) + unit.row_start + int(order[doc])
        return f"{info.path} row {row} (unit {st.unit} of epoch {st.epoch})"

    def _head_unit(self) -> _UnitTokens | None:
        s = self._state
        if s.exhausted:
            return None
        if not self._loaded:
            self._loaded.append(self._read_unit(s.epoch, s.unit, s.doc))
        return self._loaded[0]

    def _unit_after(self, i: int) -> _UnitTokens | None:
        """The i-th loaded unit (0 = head), reading ahead as needed; None past the data."""
        while len(self._loaded) <= i:
            last = self._loaded[-1]
            nxt = self._next_pos(last.epoch, last.pos)
            if nxt is None:
                return None
            self._loaded.append(self._read_unit(nxt[0], nxt[1], 0))
        return self._loaded[i]

    # -- moving the head -----------------------------------------------------------------

    def _count(self, u: _UnitTokens, a: int, b: int) -> None:
        """Counts documents [a, b) of unit ``u`` (indices relative to ``u.first_doc``)."""
        s = self._state
        if u.skipped_rows and a == 0:
            s.skipped_units[u.path] = s.skipped_units.get(u.path, 0) + u.skipped_rows
        bad = u.bad[a:b]
        s.documents += int(np.count_nonzero(bad == 0))
        for code, n in Counter(bad[bad != 0].tolist()).items():
            per_file = s.skipped.setdefault(BAD_REASONS[code], {})
            per_file[u.path] = per_file.get(u.path, 0) + n
        if self.config.packing != "concat" and self.config.long_documents == "truncate":
            lengths = np.diff(u.doc_offsets[a:b + 1])
            over = lengths[lengths > self.config.seq_len] - self.config.seq_len
            s.truncated_documents += len(over)
            s.truncated_tokens += int(over.sum())

    def _advance(self, units_done: int, tok: int | None) -> None:
        """Moves the head past ``units_done`` loaded units, then to token ``tok`` of the next
        (relative to that unit's first loaded document); None means the data ended."""
        s = self._state
        for k in range(units_done):
            u = self._loaded[k]
            self._count(u, s.doc - u.first_doc if k == 0 else 0, len(u.bad))
        del self._loaded[:units_done]
        if tok is None:
            s.exhausted = True
            self._loaded.clear()
            return
        u = self._loaded[0] if self._loaded else None
        if units_done:
            s.epoch, s.unit, s.doc, s.offset = u.epoch, u.pos, u.first_doc, 0
        rel = int(np.searchsorted(u.doc_offsets, tok, side="right")) - 1
        if tok == len(u.tokens):
            # The unit is used up: move the head to the next unit's start.
            self._count(u, s.doc - u.first_doc, len(u.bad))
            nxt = self._next_pos(u.epoch, u.pos)
            self._loaded.pop(0)
            if nxt is None:
                s.exhausted = True
                self._loaded.clear()
                return
            s.epoch, s.unit, s.doc, s.offset = nxt[0], nxt[1], 0, 0
            if self._loaded and (self._loaded[0].epoch, self._loaded[0].pos) != nxt:
                raise AssertionError("read-ahead out of order; this is a bug in ingest.stream")
            return
        self._count(u, s.doc - u.first_doc, rel)
        s.doc, s.offset = u.first_doc + rel, tok - int(u.doc_offsets[rel])

    def _head_token(self) -> int:
        """The head's index into the head unit's tokens."""
        u = self._loaded[0]
        s = self._state
        return int(u.doc_offsets[s.doc - u.first_doc]) + s.offset

    # -- producing -----------------------------------------------------------------------

    def produce(self, n_rows: int) -> Chunk:
        """The next ``n_rows`` rows (fewer only when the data ends), as a chunk.

        Raises:
          BadInputError: a bad document or file under the ``error`` policy.
          StreamError: anything else, naming the stream and its head.
        """
        if n_rows <= 0:
            raise ValueError(f"n_rows={n_rows} must be positive")
        c = self.config
        try:
            if c.packing == "concat":
                fields, documents = self._produce_concat(n_rows)
            else:
                *rows, documents = self._produce_bins(n_rows)
                fields = shift_rows(*rows, shift=c.shift,
                                    predict_across_documents=c.predict_across_documents,
                                    eos_id=self.tokenizer.eos_id)
        except (BadInputError, StreamError):
            raise
        except Exception as e:
            s = self._state
            raise StreamError(
                f"stream {self.stream_id} failed at epoch {s.epoch}, unit {s.unit}, document "
                f"{s.doc}: {type(e).__name__}: {e}", stream_id=self.stream_id) from e
        self._state.rows_emitted += fields.shape[1]
        return Chunk(self.stream_id, fields, self.get_state(), self._state.exhausted, documents)

    def _width(self) -> int:
        return self.config.seq_len + (1 if self.config.shift == "left" else 0)

    def _empty(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        w = self._width()
        return (np.zeros((0, w), np.int32), np.zeros((0, w), bool), np.zeros((0, w), bool),
                np.zeros(0, np.int64))

    def _no_fields(self) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros((len(FIELDS), 0, self.config.seq_len), np.int32), np.zeros(0, np.int64)

    def _produce_concat(self, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
        c = self.config
        L = c.seq_len
        width = self._width()
        head = self._head_unit()
        if head is None:
            return self._no_fields()
        need = (n_rows - 1) * L + width
        at = self._head_token()
        parts_t, parts_s = [head.tokens[at:]], [head.starts[at:]]
        have = len(parts_t[0])
        i = 0
        while have < need:
            u = self._unit_after(i + 1)
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
            self._advance(len(self._loaded), None)
            return self._no_fields()
        fields = concat_fields(flat_t, flat_s, rows, L, shift=c.shift,
                               predict_across_documents=c.predict_across_documents,
                               eos_id=self.tokenizer.eos_id)
        documents = self._documents_by_row(at, i + 1, rows)
        # Move the head to token rows*L past it; rows only run short when the data ended.
        target = at + rows * L
        k = 0
        while k < len(self._loaded) - 1 and target >= len(self._loaded[k].tokens):
            target -= len(self._loaded[k].tokens)
            k += 1
        if have < need and target >= len(self._loaded[k].tokens):
            self._advance(len(self._loaded), None)
        else:
            self._advance(k, target)
        return fields, documents

    def _documents_by_row(self, at: int, n_units: int, rows: int) -> np.ndarray:
        """The ``documents`` counter after each of ``rows`` rows read from token ``at`` of the
        head unit on, over the first ``n_units`` loaded units: the head passes a document once
        the rows reach its end (as ``_advance`` counts)."""
        L = self.config.seq_len
        ends, start = [], -at
        for k in range(n_units):
            u = self._loaded[k]
            first = self._state.doc - u.first_doc if k == 0 else 0
            good = u.bad[first:] == 0
            ends.append(u.doc_offsets[first + 1:][good] + start)
            start += len(u.tokens)
        ends = np.concatenate(ends) if len(ends) > 1 else ends[0]
        passed = np.searchsorted(ends, np.arange(1, rows + 1, dtype=np.int64) * L, "right")
        return passed + self._state.documents

    def _pieces(self, u: _UnitTokens, rel_doc: int, offset: int) -> tuple[list[np.ndarray],
                                                                          list[tuple]]:
        """Pieces of unit ``u`` from (rel_doc, offset) on, with the head each one starts at."""
        L = self.config.seq_len
        split = self.config.long_documents == "split"
        pieces, heads = [], []
        for d in range(rel_doc, len(u.bad)):
            a, b = int(u.doc_offsets[d]), int(u.doc_offsets[d + 1])
            if a == b:
                continue
            off = offset if d == rel_doc else 0
            if not split:
                pieces.append(u.tokens[a:a + min(L, b - a)])
                heads.append((d, 0))
                continue
            for p in range(a + off, b, L):
                pieces.append(u.tokens[p:min(p + L, b)])
                heads.append((d, p - a))
        return pieces, heads

    def _build_batch(self) -> None:
        """Packs the batch that starts at the head; remembers where the next one starts."""
        c = self.config
        head = self._head_unit()
        if head is None:
            self._batch = self._empty()
            self._batch_next = None
            return
        s = self._state
        pieces: list[np.ndarray] = []
        where: list[tuple[int, int, int]] = []  # (loaded index, rel doc, offset)
        bins: list[list[int]] = []
        consumed = 0
        i, rel, off = 0, s.doc - head.first_doc, s.offset
        while True:
            u = self._unit_after(i) if i else head
            if u is None:
                break  # The data ends inside this batch.
            p, h = self._pieces(u, rel, off)
            pieces += p
            where += [(i, d, o) for d, o in h]
            if c.packing == "none":
                bins, consumed = ([[0]], 1) if pieces else ([], 0)
            else:
                bins, consumed = assign_bins(np.array([len(x) for x in pieces], np.int64),
                                             c.seq_len, c.packing_bins, c.packing == "best_fit")
            if consumed < len(pieces):
                break
            i, rel, off = i + 1, 0, 0
        self._batch_next = where[consumed] if consumed < len(pieces) else None
        self._batch = fill_bins(pieces, bins, self._width())

    def _produce_bins(self, n_rows: int):
        out = []
        got = 0
        s = self._state
        while got < n_rows and not s.exhausted:
            if self._batch is None:
                self._build_batch()
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
                    self._advance(len(self._loaded), None)
                else:
                    k, rel, off = nxt
                    base = self._loaded[k]
                    self._advance(k, int(base.doc_offsets[rel]) + off)
                if take > 0:
                    out[-1][3][-1] = s.documents
        if not out:
            return self._empty()
        return tuple(np.concatenate([o[j] for o in out]) for j in range(4))


# The last deals made in this process: (plan, dealt) by (id(plan), num_streams, seed, epoch,
# shuffle, source, deal). The streams of a worker share its plan and each needs the same deal at
# every epoch (a mixture: each source's); dealing loops over every unit in Python (0.24 s for
# a million units), once, not once per stream.
_DEALS: OrderedDict[tuple, tuple[UnitPlan, list[np.ndarray]]] = OrderedDict()
_DEALS_KEPT = 16
_DEALS_LOCK = threading.Lock()


def _dealt(plan: UnitPlan, *, num_streams: int, seed: int, epoch: int, shuffle: bool,
           source: int | None, deal: str = "units") -> list[np.ndarray]:
    """``deal_units``, remembered for the last few deals (callers only read the arrays)."""
    key = (id(plan), num_streams, seed, epoch, shuffle, source, deal)
    with _DEALS_LOCK:
        hit = _DEALS.get(key)
        if hit is not None and hit[0] is plan:  # the same object, not a new one at a reused id
            _DEALS.move_to_end(key)
            return hit[1]
    dealt = deal_units(plan, num_streams=num_streams, seed=seed, epoch=epoch, shuffle=shuffle,
                       source=source, deal=deal)
    with _DEALS_LOCK:
        _DEALS[key] = (plan, dealt)
        while len(_DEALS) > _DEALS_KEPT:
            _DEALS.popitem(last=False)
    return dealt


def _int64_array(values: np.ndarray) -> pa.Array:
    """A numpy integer array as an Arrow int64 array, zero-copy. ``pa.array`` would import
    pandas to inspect its argument (see ``ingest.sources.numpy_view``)."""
    values = np.ascontiguousarray(values, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(values), [None, pa.py_buffer(values)])


def open_stream(config: Config, plan: UnitPlan, stream_id: int,
                tokenizer: Tokenizer | None = None) -> Stream:
    """The stream ``stream_id`` of the config: the one constructor workers, the local backend
    and tools use, so every kind of stream (text, mixture, replay) is built the same way."""
    if config.sources[0].kind == "materialized":
        from ingest.replay import ReplayStream  # noqa: PLC0415 (replay imports this module)

        return ReplayStream(config, plan, stream_id)
    if len(config.sources) > 1:
        from ingest.mixture import MixedStream  # noqa: PLC0415 (mixture imports this module)

        return MixedStream(config, plan, stream_id, tokenizer)
    return Stream(config, plan, stream_id, tokenizer)
