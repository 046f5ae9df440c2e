"""The host feed's state: its version and the check that a saved one fits a config and corpus.

``jax_side.feed.HostFeed`` writes and restores the state; ``jax_side.checkpoint`` saves it
with orbax. Both check it here, which needs neither JAX nor orbax; each kind of stream checks
its own saved state (``check_state``, ``ingest.stream.state_check``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ingest.config import Config
from ingest.plan.units import UnitPlan
from ingest.stream.kinds import stream_kind
from ingest.stream.state_check import StateInvalid, StateRanges, count, describe

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
    ranges = StateRanges(config, plan)
    kind = stream_kind(config)
    try:
        step = count(state.get("step"), "step")
    except StateInvalid as e:
        raise ValueError(f"the checkpoint's {e}; {_EDITED}") from None
    expected = config.schedule.rows_before(step)
    for sid, entry in state["streams"].items():
        try:
            if not (isinstance(sid, str) and sid.isdigit()
                    and int(sid) < config.num_streams):
                raise StateInvalid(f"stream id {sid!r} is outside 0..{config.num_streams - 1} "
                               f"(num_streams={config.num_streams})")
            s = int(sid)
            if not isinstance(entry, dict):
                raise StateInvalid(f"the entry is {describe(entry)}, not {{state, taken}}")
            taken = count(entry.get("taken"), "taken")
            if entry.get("documents") is not None:
                count(entry["documents"], "documents")
            st = entry.get("state")
            if st is not None:
                kind.check_state(st, ranges, "state", s)
            given = int((st or {}).get("rows_emitted", 0)) + taken
            ended = bool(st and st.get("exhausted")) and taken == 0
            if given > expected or (given < expected and not ended):
                raise StateInvalid(
                    f"state.rows_emitted + taken = {given} rows given, but {step} steps take "
                    f"{expected} rows of each stream ({'at most; ' if ended else ''}"
                    f"step={step} or taken={taken} is wrong)")
        except StateInvalid as e:
            raise ValueError(f"the checkpoint's stream {sid}: {e}; {_EDITED}") from None


_EDITED = ("the checkpoint was edited or corrupted, or was saved by another run; restore "
           "another step or start fresh")
