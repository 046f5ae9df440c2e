"""A text stream's head: its state, and the units loaded from the head on.

The head, (epoch, unit, doc, offset), names the next token not yet emitted. Everything else
(tokens of the head's unit, later units already read) is a cache the head rebuilds by re-reading
and re-tokenizing, which is deterministic. So the state stays small:

    state = {epoch, unit, doc, offset, batch_rows_taken, rows_emitted, exhausted, counters}

Counters (documents, skips, truncations) advance with the head, so they survive resume exactly.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from typing import Any

import numpy as np

from ingest.errors import BAD_REASONS, StreamError
from ingest.stream.chunk import state_from_json
from ingest.stream.state_check import StateInvalid, StateRanges, below, count, counter_map, short
from ingest.stream.unit_reader import UnitReader, UnitTokens

__all__ = ["STATE_VERSION", "Head", "StreamState"]

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
        """Raises ValueError: not a text stream's state, or of another version."""
        # A copy: the head's counters (skipped, poison) change in place, and the caller keeps
        # ``d`` (the feed holds it as the stream's base until the next chunk).
        return state_from_json(cls, copy.deepcopy(d), version=STATE_VERSION, kind=None,
                               what="stream",
                               hint="it was written by another ingest version or by a stream "
                                    "of another kind")

    @classmethod
    def check(cls, st: Any, ranges: StateRanges, name: str, stream: int,
              source: int | None = None) -> None:
        """Checks a saved state (``to_json``) of stream ``stream`` (of ``source`` only, for a
        mixture component) against ``ranges``: its head inside the stream's deal, its
        counters counts.

        Raises:
          StateInvalid: naming the field, its value and the allowed range.
        """
        if not isinstance(st, dict):
            raise StateInvalid(f"{name}={short(st, 60)} is not a stream state (a JSON object)")
        if st.get("version") != STATE_VERSION:
            raise StateInvalid(f"{name}.version={st.get('version')!r} is not {STATE_VERSION}")
        unknown = sorted(set(st) - {f.name for f in dataclasses.fields(cls)} - {"version"})
        if unknown:
            raise StateInvalid(f"{name} has unknown keys {unknown}")
        epoch = ranges.epoch(st.get("epoch", 0), f"{name}.epoch")
        units = ranges.units(epoch, stream, source)
        unit = below(st.get("unit", 0), f"{name}.unit", len(units),
                     f"the stream has {len(units)} unit(s) in epoch {epoch}")
        if len(units):
            rows = int(ranges.plan.units.num_rows[int(units[unit])])
            count(st.get("doc", 0), f"{name}.doc", rows,
                  f"unit {unit} of epoch {epoch} has {rows} document(s)")
        else:
            count(st.get("doc", 0), f"{name}.doc", 0, "the stream has no units")
        for key in ("offset", "batch_rows_taken", "rows_emitted", "documents",
                    "truncated_documents", "truncated_tokens"):
            count(st.get(key, 0), f"{name}.{key}")
        if not isinstance(st.get("exhausted", False), bool):
            raise StateInvalid(f"{name}.exhausted={short(st['exhausted'], 60)} is not true or "
                               f"false")
        counter_map(st.get("skipped", {}), f"{name}.skipped", 2)
        counter_map(st.get("skipped_units", {}), f"{name}.skipped_units", 1)
        poison = st.get("poison", [])
        if not isinstance(poison, list) or not all(
                isinstance(p, list) and len(p) == 3 and all(
                    isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in p)
                for p in poison):
            raise StateInvalid(f"{name}.poison={short(poison, 60)} is not a list of "
                               f"[epoch, unit, document] triples of counts")


class Head:
    """The head of a stream reading ``reader``'s units, at ``state``; ``loaded`` holds the
    head's unit (first) and the units read ahead, tokenized."""

    def __init__(self, reader: UnitReader, state: StreamState):
        self.reader = reader
        self.config = reader.config
        self.state = state
        self.loaded: list[UnitTokens] = []

    def unit(self) -> UnitTokens | None:
        s = self.state
        if s.exhausted:
            return None
        if not self.loaded:
            u = self.reader.read(s.epoch, s.unit, s.doc, s.poison)
            self._check_offset(u)
            self.loaded.append(u)
        return self.loaded[0]

    def _check_offset(self, u: UnitTokens) -> None:
        """Checks the head's ``offset`` against its document, read from the unit ``u`` at the
        head: the one field of a restored state that the plan alone cannot bound (it counts
        tokens).

        Raises:
          StreamError: ``offset`` does not name a token where this stream's head can be.
        """
        s, c = self.state, self.config
        length = int(u.doc_offsets[1] - u.doc_offsets[0]) if len(u.bad) else 0
        if c.packing == "concat":
            ok = s.offset < length or s.offset == 0
            allowed = f"0..{max(length - 1, 0)}"
        elif c.long_documents == "truncate":
            ok, allowed = s.offset == 0, "0 (long_documents: truncate)"
        else:  # packed pieces start every seq_len tokens
            ok = s.offset % c.seq_len == 0 and (s.offset < length or s.offset == 0)
            allowed = f"a multiple of seq_len={c.seq_len} in 0..{max(length - 1, 0)}"
        if ok:
            return
        source = "" if self.reader.source is None else f" (sources[{self.reader.source}])"
        raise StreamError(
            f"stream {self.reader.stream_id}{source}: its restored state has offset={s.offset}, "
            f"outside {allowed}: its document, {self.reader.describe(s.epoch, s.unit, s.doc)}, "
            f"has {length} tokens with its end-of-document token. The checkpoint was edited or corrupted, or saved over "
            f"another corpus; restore another step or start fresh",
            stream_id=self.reader.stream_id)

    def unit_after(self, i: int) -> UnitTokens | None:
        """The i-th loaded unit (0 = head), reading ahead as needed; None past the data."""
        while len(self.loaded) <= i:
            last = self.loaded[-1]
            nxt = self.reader.next_pos(last.epoch, last.pos)
            if nxt is None:
                return None
            self.loaded.append(self.reader.read(nxt[0], nxt[1], 0, self.state.poison))
        return self.loaded[i]

    def count(self, u: UnitTokens, a: int, b: int) -> None:
        """Counts documents [a, b) of unit ``u`` (indices relative to ``u.first_doc``)."""
        s = self.state
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

    def advance(self, units_done: int, tok: int | None) -> None:
        """Moves the head past ``units_done`` loaded units, then to token ``tok`` of the next
        (relative to that unit's first loaded document); None means the data ended."""
        s = self.state
        for k in range(units_done):
            u = self.loaded[k]
            self.count(u, s.doc - u.first_doc if k == 0 else 0, len(u.bad))
        del self.loaded[:units_done]
        if tok is None:
            s.exhausted = True
            self.loaded.clear()
            return
        u = self.loaded[0] if self.loaded else None
        if units_done:
            s.epoch, s.unit, s.doc, s.offset = u.epoch, u.pos, u.first_doc, 0
        rel = int(np.searchsorted(u.doc_offsets, tok, side="right")) - 1
        if tok == len(u.tokens):
            # The unit is used up: move the head to the next unit's start.
            self.count(u, s.doc - u.first_doc, len(u.bad))
            nxt = self.reader.next_pos(u.epoch, u.pos)
            self.loaded.pop(0)
            if nxt is None:
                s.exhausted = True
                self.loaded.clear()
                return
            s.epoch, s.unit, s.doc, s.offset = nxt[0], nxt[1], 0, 0
            if self.loaded and (self.loaded[0].epoch, self.loaded[0].pos) != nxt:
                raise AssertionError("read-ahead out of order; this is a bug in ingest.stream.head")
            return
        self.count(u, s.doc - u.first_doc, rel)
        s.doc, s.offset = u.first_doc + rel, tok - int(u.doc_offsets[rel])

    def token(self) -> int:
        """The head's index into the head unit's tokens."""
        u = self.loaded[0]
        s = self.state
        return int(u.doc_offsets[s.doc - u.first_doc]) + s.offset

    def add_poison(self, where: dict[str, Any]) -> None:
        """Marks the document ``where`` (from a trace) to be skipped as ``worker_crash``."""
        entry = [int(where["epoch"]), int(where["unit"]), int(where["doc"])]
        if entry not in self.state.poison:
            self.state.poison.append(entry)
        self.loaded.clear()

    def describe(self) -> str:
        """Where the head is, in the corpus's terms: ``FILE row N (unit U of epoch E)``."""
        st = self.state
        if st.exhausted:
            return "the end of its data"
        return self.reader.describe(st.epoch, st.unit, st.doc)
