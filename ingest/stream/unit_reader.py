"""Reading a stream's units: which units it reads each epoch, and each unit's documents as
tokens.

``UnitReader.units(epoch)`` is the stream's share of the epoch's deal (``ingest.plan.deal``), shared
by the streams of a process; ``read`` reads one unit's rows (``ingest.sources.files``), puts them in
the epoch's reading order, sorts out bad documents by the config's policies and tokenizes the
rest, each followed by EOS, into a ``UnitTokens``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ingest.config import Config
from ingest.errors import BAD_REASONS, BadInputError
from ingest.plan.deal import deal_units, permutation
from ingest.plan.units import UnitPlan
from ingest.sources.columns import decode_texts, numpy_view
from ingest.sources.files import position, read_texts
from ingest.tokenize.tokenizer import Tokenizer, bos_id_of, docs_of, with_bos, with_eos

__all__ = ["UnitReader", "UnitTokens"]


@dataclasses.dataclass
class UnitTokens:
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


class UnitReader:
    """The units of stream ``stream_id`` over a plan (of source ``source`` only, for a mixture
    component; None: every source's units, pooled), read and tokenized."""

    def __init__(self, config: Config, plan: UnitPlan, stream_id: int, tokenizer: Tokenizer,
                 source: int | None = None):
        self.config = config
        self.plan = plan
        self.stream_id = stream_id
        self.tokenizer = tokenizer
        self.source = source
        self._bos = bos_id_of(tokenizer, config.bos)  # None: no id before documents
        # Called with each document's place before it is tokenized (see Stream.set_trace).
        self.trace = None
        self._tokenizer_error = ""
        self._deals: dict[int, np.ndarray] = {}

    def units(self, epoch: int) -> np.ndarray:
        """Indices into the plan's units this stream reads in ``epoch``, in reading order."""
        if epoch not in self._deals:
            c = self.config
            self._deals = {epoch: _dealt(self.plan, num_streams=c.num_streams, seed=c.seed,
                                         epoch=epoch, shuffle=c.shuffle, source=self.source,
                                         deal=c.deal)[self.stream_id]}
        return self._deals[epoch]

    def next_pos(self, epoch: int, pos: int) -> tuple[int, int] | None:
        """The (epoch, unit position) after ``pos``, or None at the end of finite data."""
        pos += 1
        if pos >= len(self.units(epoch)):
            epoch, pos = epoch + 1, 0
            if self.config.num_epochs is not None and epoch >= self.config.num_epochs:
                return None
        return epoch, pos

    def _order(self, epoch: int, uid: int) -> np.ndarray:
        """The reading order of unit ``uid``'s rows in ``epoch``."""
        n = self.plan.units[uid].num_rows
        if self.config.shuffle:
            return permutation(n, self.config.seed, epoch, uid, 0xD0C)
        return np.arange(n)

    def read(self, epoch: int, pos: int, first_doc: int,
             poison: list[list[int]] = ()) -> UnitTokens:
        """Unit ``pos`` of ``epoch`` from document ``first_doc`` on, tokenized; ``poison``:
        ``[epoch, unit, doc]`` of documents to skip as ``worker_crash``.

        Raises:
          BadInputError: a bad document or file under the ``error`` policies.
        """
        c = self.config
        uid = int(self.units(epoch)[pos])
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
            return UnitTokens(epoch, pos, first_doc, np.zeros(0, np.int32), np.zeros(0, bool),
                               np.zeros(1, np.int64), np.zeros(0, np.int8), info.path,
                               skipped_rows=unit.num_rows - first_doc)
        order = self._order(epoch, uid)[first_doc:]
        arr = arr.take(_int64_array(order))
        pretokenized = bool(self.plan.pretokenized and self.plan.pretokenized[unit.source])
        if pretokenized:
            texts, bad = None, self._check_ids(arr)
        else:
            texts, bad = decode_texts(arr)
        if pre_bad is not None:
            pre = pre_bad[order]
            bad = np.where(pre != 0, pre, bad)
        for e, p, d in poison:
            # Documents located as killing their worker (actors.poison), skipped by config.
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
        if self._bos is not None:
            tokens, eos_at = with_bos(tokens, eos_at, self._bos)
        # The good documents' tokens (each with its EOS) are back to back; a bad one has none.
        offsets = np.zeros(len(bad) + 1, dtype=np.int64)
        offsets[1:][bad == 0] = eos_at + 1
        np.maximum.accumulate(offsets, out=offsets)
        starts = np.zeros(len(tokens), dtype=bool)
        starts[offsets[:-1][bad == 0]] = True
        return UnitTokens(epoch, pos, first_doc, tokens, starts, offsets, bad, info.path)

    def _encode(self, texts: list[str], epoch: int, pos: int, docs: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Token ids of ``texts`` (documents ``docs`` of unit ``pos``), each followed by EOS,
        back to back; the index of each EOS; and the indices of the texts the tokenizer
        failed on (left out of both).

        One call for all normally; one document at a time when the batch fails (to find which)
        or while traced (``set_trace``: the trace names each document before it is tokenized,
        so a document that kills the process is known afterwards).
        """
        if self.trace is None:
            try:
                return (*self.tokenizer.encode_docs(texts), [])
            except BaseException as e:  # noqa: BLE001 -- tokenizers panic with BaseException
                if isinstance(e, KeyboardInterrupt | SystemExit | GeneratorExit):
                    raise
        out, failed = self._encode_one_by_one(texts, epoch, pos, docs)
        return (*docs_of(out, self.tokenizer.eos_id), failed)

    def _encode_one_by_one(self, texts: list[str], epoch: int, pos: int, docs: np.ndarray
                           ) -> tuple[list[np.ndarray], list[int]]:
        out: list[np.ndarray] = []
        failed = []
        for i, (t, d) in enumerate(zip(texts, docs.tolist(), strict=True)):
            if self.trace is not None:
                self.trace({"source": self.source, "epoch": epoch, "unit": pos, "doc": d})
            try:
                out.append(self.tokenizer.encode_batch([t])[0])
            except BaseException as e:  # noqa: BLE001
                if isinstance(e, KeyboardInterrupt | SystemExit | GeneratorExit):
                    raise
                self._tokenizer_error = f"{type(e).__name__}: {e}"
                failed.append(i)
        return out, failed

    def _raise_first_bad(self, bad: np.ndarray, info, unit, order: np.ndarray,
                         detail: str | None = None) -> None:
        """Under ``on_bad_document: error``, raises for the first bad document, naming it."""
        if not bad.any() or self.config.on_bad_document != "error":
            return
        i = int(np.flatnonzero(bad)[0])
        row = sum(info.row_groups[:unit.group]) + unit.row_start + int(order[i])
        reason = BAD_REASONS[bad[i]]
        raise BadInputError(
            f"{info.path}: {position(info, row, unit.group)}, column "
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

    def describe(self, epoch: int, pos: int, doc: int) -> str:
        """Document ``doc`` of unit ``pos`` of ``epoch``, in the corpus's terms:
        ``FILE row N (unit U of epoch E)``."""
        uid = int(self.units(epoch)[pos])
        unit = self.plan.units[uid]
        info = self.plan.files[unit.file]
        order = self._order(epoch, uid)
        row = (sum(info.row_groups[:unit.group]) + unit.row_start
               + int(order[min(doc, unit.num_rows - 1)]))
        return f"{info.path} {position(info, row)} (unit {pos} of epoch {epoch})"


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
    pandas to inspect its argument (see ``ingest.sources.columns.numpy_view``)."""
    values = np.ascontiguousarray(values, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(values), [None, pa.py_buffer(values)])
