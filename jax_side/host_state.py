"""The host feed's state: its version and the check that a saved one fits a config and corpus.

``jax_side.feed.HostFeed`` writes and restores the state; ``jax_side.checkpoint`` saves it
with orbax. Both check it here, which needs neither JAX nor orbax.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ingest.config import Config
from ingest.deal import deal_units
from ingest.replay import MaterializedPlan
from ingest.stream_head import STATE_VERSION, StreamState
from ingest.units import UnitPlan

__all__ = ["HOST_STATE_VERSION", "StateHeader", "check_compatible", "check_restorable",
           "validate_state"]

log = logging.getLogger(__name__)

HOST_STATE_VERSION = 1
"""The version ``HostFeed.get_state`` writes; restoring accepts this one only."""


@dataclasses.dataclass(frozen=True)
class StateHeader:
    """What every host state of one feed holds besides its position: the version and the
    fingerprints that ``check_compatible`` compares on restore.

    Attributes:
      config_fingerprint: ``Config.fingerprint()``.
      config: ``Config.output_fields()``, the fields that decide the batches.
      corpus_fingerprint: the plan's fingerprint (the files and their locations).
      corpus_content: the plan's content fingerprint, without the locations ("": none).
    """

    config_fingerprint: str
    config: dict[str, Any]
    corpus_fingerprint: str
    corpus_content: str

    @classmethod
    def of(cls, config: Config, plan: UnitPlan) -> StateHeader:
        # Constant for the feed; computed once (per step it would be a sixth of the host's cost).
        return cls(config.fingerprint(), config.output_fields(), plan.fingerprint,
                   plan.content_fingerprint)

    def state(self, step: int, streams: dict[str, Any]) -> dict[str, Any]:
        """The host state after ``step`` steps, with each stream's entry in ``streams``."""
        state = {
            "version": HOST_STATE_VERSION,
            "config_fingerprint": self.config_fingerprint,
            "config": self.config,
            "corpus_fingerprint": self.corpus_fingerprint,
            "step": step,
            "streams": streams,
        }
        if self.corpus_content:
            # Without the files' locations: lets a moved corpus restore (check_compatible).
            state["corpus_content"] = self.corpus_content
        return state


def _moved(state: dict[str, Any], now: dict[str, Any], plan: UnitPlan) -> bool:
    """Whether the saved corpus is ``plan``'s, moved: only ``sources[].paths`` differ, and the
    files found there are the same (paths relative to their source's folder, sizes, row
    groups, content keys, order)."""
    saved = state.get("config", {})
    if (saved == now or not plan.content_fingerprint
            or state.get("corpus_content") != plan.content_fingerprint):
        return False
    without = [{**s, "paths": None} for s in saved.get("sources", [])]
    return ({**saved, "sources": without}
            == {**now, "sources": [{**s, "paths": None} for s in now["sources"]]})


def check_compatible(state: dict[str, Any], config: Config, plan: UnitPlan) -> None:
    """Checks that a saved host state can continue under ``config`` over ``plan``.

    Runtime fields (workers, chunk_rows, prefetch) may differ; every other field and the
    corpus must be as saved.

    Raises:
      ValueError: naming every difference that would change the batches.
    """
    if not isinstance(state, dict) or "streams" not in state:
        raise ValueError("not a HostFeed state: expected a dict with 'streams' (was it written "
                         "by HostFeed.get_state?)")
    if state.get("version") != HOST_STATE_VERSION:
        raise ValueError(f"feed state version {state.get('version')!r} is not supported "
                         f"(expected {HOST_STATE_VERSION})")
    problems = []
    saved = state.get("config", {})
    now = config.output_fields()
    moved = _moved(state, now, plan)
    for key in sorted(set(saved) | set(now)):
        if saved.get(key) != now.get(key) and not (key == "sources" and moved):
            problems.append(f"{key}: checkpoint has {saved.get(key)!r}, config has "
                            f"{now.get(key)!r}")
    if state.get("corpus_fingerprint") != plan.fingerprint and not moved:
        problems.append(f"the corpus changed (fingerprint {state.get('corpus_fingerprint')} in "
                        f"the checkpoint, {plan.fingerprint} now): files were added, removed or "
                        f"rewritten"
                        + ("" if "corpus_content" in state or not plan.content_fingerprint else
                           "; a corpus moved elsewhere restores only from checkpoints saved "
                           "with its content fingerprint (the state's corpus_content)"))
    if moved:
        log.warning("the corpus moved (sources[].paths %s in the checkpoint, %s now): the same "
                    "files relative to their folders, with the same sizes, row groups and "
                    "content, in the same order; restoring there",
                    [s["paths"] for s in saved["sources"]], [s["paths"] for s in now["sources"]])
    if problems:
        raise ValueError("cannot restore the feed: " + "; ".join(problems)
                         + ". Restore with the original config and corpus, or start fresh.")
    validate_state(state, config, plan)


def check_restorable(state: dict[str, Any], config: Config, plan: UnitPlan,
                     streams: tuple[int, ...]) -> None:
    """Checks that a saved host state can continue ``streams`` under ``config`` over ``plan``:
    ``check_compatible``, and an entry for every one of ``streams`` (a merged multi-host state
    may hold more).

    Raises:
      ValueError: incompatible config or corpus (naming what changed), missing streams.
    """
    check_compatible(state, config, plan)
    missing = [s for s in streams if str(s) not in state["streams"]]
    if missing:
        raise ValueError(f"the state has no entry for stream(s) {missing}; it was saved "
                         f"with another num_streams or is incomplete")


# -- every field against the plan --------------------------------------------------------------


class _Invalid(ValueError):
    """One field of a saved state out of its range (``validate_state`` adds where)."""


def _count(value: Any, name: str, upper: int | None = None, what: str = "") -> int:
    """``value`` as a count in ``0..upper`` (inclusive; no upper bound when None)."""
    allowed = f"0..{upper}" if upper is not None else "an integer >= 0"
    if (isinstance(value, bool) or not isinstance(value, int) or value < 0
            or (upper is not None and value > upper)):
        raise _Invalid(f"{name}={_short(value, 60)} is outside {allowed}"
                       + (f" ({what})" if what else ""))
    return value


def _below(value: Any, name: str, limit: int, what: str) -> int:
    """``value`` as an index in ``0..limit - 1`` (``0`` only when ``limit`` is 0)."""
    return _count(value, name, max(limit - 1, 0), what)


def _counter_map(value: Any, name: str, depth: int) -> None:
    """``{key: count}`` (depth 1) or ``{key: {key: count}}`` (depth 2) with counts >= 0."""
    if not isinstance(value, dict):
        raise _Invalid(f"{name}={_short(value, 60)} is not a JSON object of counts")
    for k, v in value.items():
        if depth > 1:
            _counter_map(v, f"{name}[{k!r}]", depth - 1)
        else:
            _count(v, f"{name}[{k!r}]")


class _StateRanges:
    """The allowed range of every field of a stream state, from the config and the plan."""

    def __init__(self, config: Config, plan: UnitPlan):
        self.config = config
        self.plan = plan
        self._deals: dict[tuple[int, int | None], list[Any]] = {}

    def units(self, epoch: int, stream: int, source: int | None) -> Any:
        """The unit ids ``stream`` reads in ``epoch`` (of one source in a mixture)."""
        key = (epoch, source)
        if key not in self._deals:
            c = self.config
            self._deals[key] = deal_units(self.plan, num_streams=c.num_streams, seed=c.seed,
                                          epoch=epoch, shuffle=c.shuffle, source=source,
                                          deal=c.deal)
        return self._deals[key][stream]

    def epoch(self, value: Any, name: str) -> int:
        epochs = self.config.num_epochs
        if epochs is None:
            return _count(value, name)
        return _below(value, name, epochs, f"num_epochs={epochs}")

    def text(self, st: Any, name: str, stream: int, source: int | None) -> None:
        """A text stream's state (``ingest.stream.StreamState.to_json``)."""
        if not isinstance(st, dict):
            raise _Invalid(f"{name}={_short(st, 60)} is not a stream state (a JSON object)")
        if st.get("version") != STATE_VERSION:
            raise _Invalid(f"{name}.version={st.get('version')!r} is not {STATE_VERSION}")
        fields = {f.name for f in dataclasses.fields(StreamState)} | {"version"}
        unknown = sorted(set(st) - fields)
        if unknown:
            raise _Invalid(f"{name} has unknown keys {unknown}")
        epoch = self.epoch(st.get("epoch", 0), f"{name}.epoch")
        units = self.units(epoch, stream, source)
        unit = _below(st.get("unit", 0), f"{name}.unit", len(units),
                      f"the stream has {len(units)} unit(s) in epoch {epoch}")
        if len(units):
            rows = int(self.plan.units.num_rows[int(units[unit])])
            _count(st.get("doc", 0), f"{name}.doc", rows,
                   f"unit {unit} of epoch {epoch} has {rows} document(s)")
        else:
            _count(st.get("doc", 0), f"{name}.doc", 0, "the stream has no units")
        for key in ("offset", "batch_rows_taken", "rows_emitted", "documents",
                    "truncated_documents", "truncated_tokens"):
            _count(st.get(key, 0), f"{name}.{key}")
        if not isinstance(st.get("exhausted", False), bool):
            raise _Invalid(f"{name}.exhausted={_short(st['exhausted'], 60)} is not true or false")
        _counter_map(st.get("skipped", {}), f"{name}.skipped", 2)
        _counter_map(st.get("skipped_units", {}), f"{name}.skipped_units", 1)
        poison = st.get("poison", [])
        if not isinstance(poison, list) or not all(
                isinstance(p, list) and len(p) == 3 and all(
                    isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in p)
                for p in poison):
            raise _Invalid(f"{name}.poison={_short(poison, 60)} is not a list of "
                           f"[epoch, unit, document] triples of counts")

    def mixture(self, st: Any, name: str, stream: int) -> None:
        """A mixed stream's state (``ingest.mixture.MixedStream.get_state``)."""
        n = len(self.config.sources)
        if not isinstance(st, dict) or st.get("kind") != "mixture":
            raise _Invalid(f"{name} is not a mixture state (the config has {n} sources)")
        comps = st.get("components")
        if not isinstance(comps, list) or len(comps) != n:
            raise _Invalid(f"{name}.components holds {_describe(comps)}, not one entry per "
                           f"source ({n})")
        for i, comp in enumerate(comps):
            where = f"{name}.components[{i}]"
            if not isinstance(comp, dict):
                raise _Invalid(f"{where} is {_describe(comp)}, not {{state, taken}}")
            if comp.get("state") is not None:
                self.text(comp["state"], f"{where}.state", stream, i)
            _count(comp.get("taken"), f"{where}.taken")
        for key in ("credit", "tokens", "rows", "component_documents"):
            values = st.get(key, [0] * n)
            if not isinstance(values, list) or len(values) not in (0, n):
                raise _Invalid(f"{name}.{key} holds {_describe(values)}, not {n} counts")
            for i, v in enumerate(values):
                _count(v, f"{name}.{key}[{i}]")
        _count(st.get("rows_emitted", 0), f"{name}.rows_emitted")

    def replay(self, st: Any, name: str, stream: int) -> None:
        """A materialized directory's stream state (``ingest.replay.ReplayState``)."""
        if not isinstance(st, dict) or st.get("kind") != "replay":
            raise _Invalid(f"{name} is not a replay state (the source is materialized)")
        epoch = self.epoch(st.get("epoch", 0), f"{name}.epoch")
        del epoch
        segments = self.plan.stream_units[stream]
        seg = _count(st.get("segment", 0), f"{name}.segment", len(segments),
                     f"the stream has {len(segments)} segment(s)")
        rows = (int(self.plan.units.num_rows[segments[seg]]) if seg < len(segments) else 0)
        _count(st.get("row", 0), f"{name}.row", rows, f"segment {seg} has {rows} row(s)")
        _count(st.get("rows_emitted", 0), f"{name}.rows_emitted")

    def rows_before(self, step: int) -> int:
        """Rows one stream gives to steps ``0..step-1`` (ramp-up included)."""
        return self.config.schedule.rows_before(step)


def validate_state(state: dict[str, Any], config: Config, plan: UnitPlan) -> None:
    """Checks every field of a host state against ``config`` and ``plan``.

    Positions (epoch, unit, document, segment, row) must lie inside the plan's deal for their
    stream, counters must be counts, and the rows each stream has given (its state's
    ``rows_emitted`` plus ``taken``) must be the rows ``step`` steps take from a stream
    (at most that many once the stream has ended). The checksum of the process file guards
    the values in range; this guards checkpoints saved without one.

    Raises:
      ValueError: naming the stream, the field, its value and the allowed range.
    """
    ranges = _StateRanges(config, plan)
    try:
        step = _count(state.get("step"), "step")
    except _Invalid as e:
        raise ValueError(f"the checkpoint's {e}; {_EDITED}") from None
    expected = ranges.rows_before(step)
    replay = isinstance(plan, MaterializedPlan)
    for sid, entry in state["streams"].items():
        try:
            if not (isinstance(sid, str) and sid.isdigit()
                    and int(sid) < config.num_streams):
                raise _Invalid(f"stream id {sid!r} is outside 0..{config.num_streams - 1} "
                               f"(num_streams={config.num_streams})")
            s = int(sid)
            if not isinstance(entry, dict):
                raise _Invalid(f"the entry is {_describe(entry)}, not {{state, taken}}")
            taken = _count(entry.get("taken"), "taken")
            if entry.get("documents") is not None:
                _count(entry["documents"], "documents")
            st = entry.get("state")
            if st is not None:
                if replay:
                    ranges.replay(st, "state", s)
                elif len(config.sources) > 1:
                    ranges.mixture(st, "state", s)
                else:
                    ranges.text(st, "state", s, None)
            given = int((st or {}).get("rows_emitted", 0)) + taken
            ended = bool(st and st.get("exhausted")) and taken == 0
            if given > expected or (given < expected and not ended):
                raise _Invalid(
                    f"state.rows_emitted + taken = {given} rows given, but {step} steps take "
                    f"{expected} rows of each stream ({'at most; ' if ended else ''}"
                    f"step={step} or taken={taken} is wrong)")
        except _Invalid as e:
            raise ValueError(f"the checkpoint's stream {sid}: {e}; {_EDITED}") from None


def _describe(x: Any) -> str:
    if isinstance(x, dict):
        return f"a dict with keys {sorted(map(str, x))}"
    return f"a {type(x).__name__}"


def _short(x: Any, limit: int = 200) -> str:
    s = repr(x)
    return s if len(s) <= limit else s[:limit] + "..."


_EDITED = ("the checkpoint was edited or corrupted, or was saved by another run; restore "
           "another step or start fresh")
