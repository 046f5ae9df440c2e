"""Mixtures: one stream drawing rows from several sources in proportion to their weights.

With several ``sources``, every stream ``s`` runs one component per source (a ``Stream`` over
that source's units only, dealt to the ``num_streams`` streams like any plan) and takes each
next row from the component that is furthest behind its share, in tokens::

    weights 3 : 1          tokens taken / weight        next row from
    row 0                  a 0/3    b 0/1               a  (ties: lowest index)
    row 1                  a 1024/3 b 0/1               b
    row 2                  a 341    b 1024              a
    row 3                  a 683    b 1024              a
    row 4                  a 1024   b 1024              a ...  -> 3 of every 4 rows from a

Tokens are the row's non-padding tokens, so the realized proportions follow the weights in
tokens (within one row) whatever the packing. The choice is a pure function of the tokens
taken, so it needs no random generator and is exact on resume.

State: for each component the state after its last chunk produced (``base``) and the rows of
that chunk already taken; the tokens taken per component under the weights in force; totals
for reporting. Components produce a few rows ahead of the mixture; those rows are rebuilt on
restore, so the saved state stays positions only.

Changing weights on resume is allowed: every component keeps its position (no document is
repeated or skipped), and the new weights apply from the resume step on (the tokens taken
under the old weights are kept in the totals, not in the share). The batches after the resume
then differ from a run that had the new weights from the start.

A component of finite data (``num_epochs``) that ends drops out; the others go on with their
weights renormalized, and the mixture ends when every component has.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np

from ingest.config import Config
from ingest.plan.units import UnitPlan
from ingest.stream.chunk import Chunk, ChunkStream, state_from_json
from ingest.stream.chunk_format import LAYOUT_FIELDS, new_rows
from ingest.stream.state_check import StateInvalid, StateRanges, count, describe
from ingest.stream.text import Stream, StreamState
from ingest.tokenize.tokenizer import Tokenizer, load_tokenizer

__all__ = ["MixedStream", "MixtureState"]

MIXTURE_STATE_VERSION = 1
_SEG = LAYOUT_FIELDS.index("inputs_segmentation")
# Rows a component produces past the mixture's need, so a chunk of the mixture costs about
# one call per component rather than one per row.
_READ_AHEAD_ROWS = 4
# Counters summed over components into the mixture's state, for the feed's stats (documents
# are counted by row instead: MixtureState.component_documents).
_SUMMED = ("truncated_documents", "truncated_tokens")
# Keys of a saved state derived from the components' states, for readers (see get_state).
_DERIVED = frozenset((*_SUMMED, "documents", "skipped", "skipped_units"))


@dataclasses.dataclass
class MixtureState:
    """Where a mixed stream is; JSON at the boundary only.

    Attributes:
      components: per source, ``{"state": Stream state after its last chunk (None: its
        start), "taken": rows of that chunk already used}``.
      weights: the weights the ``credit`` was taken under.
      credit: tokens taken per source under ``weights``.
      tokens, rows: tokens and rows taken per source since the start (reported).
      rows_emitted: rows produced.
      exhausted: every component has ended.
      component_documents: per source, its ``documents`` counter after the rows taken (the
        components' states run up to a chunk behind). Absent in states saved before it.
    """

    components: list[dict[str, Any]]
    weights: list[float]
    credit: list[int]
    tokens: list[int]
    rows: list[int]
    rows_emitted: int = 0
    exhausted: bool = False
    component_documents: list[int] = dataclasses.field(default_factory=list)

    @classmethod
    def start(cls, weights: list[float]) -> MixtureState:
        n = len(weights)
        return cls([{"state": None, "taken": 0} for _ in range(n)], list(weights), [0] * n,
                   [0] * n, [0] * n, component_documents=[0] * n)

    @classmethod
    def check(cls, st: Any, ranges: StateRanges, name: str, stream: int) -> None:
        """Checks a saved state (``MixedStream.get_state``) of stream ``stream``: one entry
        per source, each component's state as its text stream checks it, counters counts.

        Raises:
          StateInvalid: naming the field, its value and the allowed range.
        """
        n = len(ranges.config.sources)
        if not isinstance(st, dict) or st.get("kind") != "mixture":
            raise StateInvalid(f"{name} is not a mixture state (the config has {n} sources)")
        comps = st.get("components")
        if not isinstance(comps, list) or len(comps) != n:
            raise StateInvalid(f"{name}.components holds {describe(comps)}, not one entry per "
                               f"source ({n})")
        for i, comp in enumerate(comps):
            where = f"{name}.components[{i}]"
            if not isinstance(comp, dict):
                raise StateInvalid(f"{where} is {describe(comp)}, not {{state, taken}}")
            if comp.get("state") is not None:
                StreamState.check(comp["state"], ranges, f"{where}.state", stream, i)
            count(comp.get("taken"), f"{where}.taken")
        for key in ("credit", "tokens", "rows", "component_documents"):
            values = st.get(key, [0] * n)
            if not isinstance(values, list) or len(values) not in (0, n):
                raise StateInvalid(f"{name}.{key} holds {describe(values)}, not {n} counts")
            for i, v in enumerate(values):
                count(v, f"{name}.{key}[{i}]")
        count(st.get("rows_emitted", 0), f"{name}.rows_emitted")


@dataclasses.dataclass
class _Component:
    stream: Stream
    rows: tuple[np.ndarray, np.ndarray] | None = None  # the last chunk's (tokens, layout)
    documents: np.ndarray | None = None  # its documents counter by row
    state_after: dict[str, Any] | None = None
    chunk_exhausted: bool = False
    exhausted: bool = False


class MixedStream(ChunkStream):
    """Stream ``stream_id`` of a config with several sources (see the module docstring).

    A ``ChunkStream``: ``produce(n)``, ``get_state``/``set_state``, ``describe_head``; and
    ``set_trace``/``add_poison`` as ``ingest.stream.text.Stream``.
    """

    def __init__(self, config: Config, plan: UnitPlan, stream_id: int,
                 tokenizer: Tokenizer | None = None):
        super().__init__(config, plan, stream_id)
        tokenizer = tokenizer or load_tokenizer(config.tokenizer,
                                                config.runtime.tokenizer_backend)
        self.tokenizer = tokenizer
        self._weights = [float(s.weight) for s in config.sources]
        self._components = [_Component(Stream(config, plan, stream_id, tokenizer, source=i))
                            for i in range(len(config.sources))]
        self.set_state(None)

    # -- state ---------------------------------------------------------------------------

    def get_state(self) -> dict[str, Any]:
        st = self._state
        d = dataclasses.asdict(st)
        d["version"] = MIXTURE_STATE_VERSION
        d["kind"] = "mixture"
        # Component counters as of the start of their current chunk, summed for the feed's
        # stats (up to a chunk behind the rows taken; exact once the data ends).
        subs = [c["state"] or {} for c in st.components]
        for name in _SUMMED:
            d[name] = sum(s.get(name, 0) for s in subs)
        d["documents"] = sum(st.component_documents)
        skipped: dict[str, dict[str, int]] = {}
        skipped_units: dict[str, int] = {}
        for s in subs:
            for reason, per_file in s.get("skipped", {}).items():
                for path, n in per_file.items():
                    skipped.setdefault(reason, {})[path] = skipped.get(reason, {}).get(path, 0) + n
            for path, n in s.get("skipped_units", {}).items():
                skipped_units[path] = skipped_units.get(path, 0) + n
        d["skipped"], d["skipped_units"] = skipped, skipped_units
        return d

    @classmethod
    def check_state(cls, state: Any, ranges: StateRanges, name: str, stream: int) -> None:
        MixtureState.check(state, ranges, name, stream)

    def set_state(self, state: dict[str, Any] | None) -> None:
        """Restores a state from ``get_state`` (None: the start). Weights that differ from the
        saved ones take effect from here (see the module docstring)."""
        if state is None:
            st = MixtureState.start(self._weights)
        else:
            # A copy: the caller keeps ``state`` (the feed holds it as the stream's base),
            # and the components' positions below change as rows are taken.
            st = state_from_json(
                MixtureState, copy.deepcopy(state), version=MIXTURE_STATE_VERSION, kind="mixture",
                what="mixture", derived=_DERIVED,
                hint=f"stream {self.stream_id} was saved with another number of sources")
            if len(st.components) != len(self._components):
                raise ValueError(
                    f"stream {self.stream_id}: the saved mixture has {len(st.components)} "
                    f"sources, the config {len(self._components)}; sources cannot be added or "
                    f"removed on resume")
            if st.weights != self._weights:
                st.weights, st.credit = list(self._weights), [0] * len(self._weights)
            if not st.component_documents:  # a state saved without the field
                st.component_documents = [(c["state"] or {}).get("documents", 0)
                                          for c in st.components]
        self._state = st
        for c, saved in zip(self._components, st.components, strict=True):
            c.stream.set_state(saved["state"] if saved["state"] is not None
                               else StreamState().to_json())
            c.rows, c.state_after, c.chunk_exhausted = None, None, False
            c.exhausted = bool(saved["state"] and saved["state"].get("exhausted")
                               and saved["taken"] == 0)

    # -- producing -----------------------------------------------------------------------

    def _pick(self) -> int | None:
        """The live component furthest behind its weight (ties: the lowest index)."""
        st = self._state
        best, best_key = None, None
        for i, c in enumerate(self._components):
            if c.exhausted:
                continue
            key = st.credit[i] / st.weights[i]
            if best_key is None or key < best_key:
                best, best_key = i, key
        return best

    def _take_row(self, i: int, want: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The next row of component i (its ``tokens`` and ``layout``, ``[2, L]`` and
        ``[3, L]``), or None when it has ended."""
        c = self._components[i]
        saved = self._state.components[i]
        if self._settle(i):
            return None
        if c.rows is None or saved["taken"] >= c.rows[0].shape[1]:
            if c.rows is not None:
                saved["state"], saved["taken"] = c.state_after, 0
            # After a restore, the chunk starts at ``base`` and its first ``taken`` rows were
            # used already.
            chunk = c.stream.produce(saved["taken"] + want + _READ_AHEAD_ROWS)
            c.rows, c.state_after, c.chunk_exhausted = ((chunk.tokens, chunk.layout),
                                                        chunk.state_after, chunk.exhausted)
            c.documents = chunk.documents
            if self._settle(i):
                return None
        row = (c.rows[0][:, saved["taken"]], c.rows[1][:, saved["taken"]])
        self._state.component_documents[i] = int(c.documents[saved["taken"]])
        saved["taken"] += 1
        return row

    def _settle(self, i: int) -> bool:
        """Whether component i has ended. Once its last chunk is used up, its saved state
        becomes the final one, so its counters (documents, skips) are complete."""
        c = self._components[i]
        saved = self._state.components[i]
        if (not c.exhausted and c.rows is not None and c.chunk_exhausted
                and saved["taken"] >= c.rows[0].shape[1]):
            saved["state"], saved["taken"] = c.state_after, 0
            c.rows, c.exhausted = None, True
        return c.exhausted

    def _produce(self, n_rows: int) -> Chunk:
        """The next ``n_rows`` rows (fewer only when every component has ended)."""
        st = self._state
        L = self.config.seq_len
        out_tokens, out_layout = new_rows(n_rows, L, zeros=True)
        documents = np.zeros(n_rows, np.int64)
        total_w = sum(self._weights)
        got = 0
        while got < n_rows and not st.exhausted:
            i = self._pick()
            if i is None:
                st.exhausted = True
                break
            want = max(1, round((n_rows - got) * self._weights[i] / total_w))
            row = self._take_row(i, want)
            if row is None:
                continue
            out_tokens[:, got], out_layout[:, got] = row
            documents[got] = sum(st.component_documents)
            tokens = int(np.count_nonzero(row[1][_SEG]))
            st.credit[i] += tokens
            st.tokens[i] += tokens
            st.rows[i] += 1
            got += 1
        ended = [self._settle(j) for j in range(len(self._components))]
        if all(ended):
            st.exhausted = True
        st.rows_emitted += got
        return Chunk(self.stream_id, out_tokens[:, :got], out_layout[:, :got], self.get_state(),
                     st.exhausted, documents[:got])

    def set_trace(self, trace) -> None:
        """See ``Stream.set_trace``; the trace names the component as ``source``."""
        for c in self._components:
            c.stream.set_trace(trace)

    def add_poison(self, where: dict[str, Any]) -> None:
        """See ``Stream.add_poison``: marks a document of component ``where["source"]``."""
        i = int(where["source"])
        c, saved = self._components[i], self._state.components[i]
        base = dict(saved["state"] or StreamState().to_json())
        c.stream.set_state(base)
        c.stream.add_poison(where)
        saved["state"] = c.stream.get_state()
        # Rebuilt from the new base on the next row (the rows taken are skipped again).
        c.rows, c.state_after, c.chunk_exhausted = None, None, False

    def describe_head(self) -> str:
        i = self._pick()
        if i is None:
            return "the end of its data"
        return f"sources[{i}]: {self._components[i].stream.describe_head()}"

