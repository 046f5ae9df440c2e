"""Checking a saved stream state against the config and plan before it is restored.

A checkpoint's stream states are JSON that a user can edit, truncate or bring from another
run. Each kind of stream checks its own state (``check_state`` of ``ingest.stream.text.Stream``,
``ingest.stream.mixture.MixedStream`` and ``ingest.materialize.replay.ReplayStream``) with the helpers here:
every position must lie inside the plan's deal for its stream, and every counter must be a
count. ``StateInvalid`` names the field, its value and the allowed range; the host feed adds
which stream and checkpoint it came from.
"""

from __future__ import annotations

from typing import Any

from ingest.config import Config
from ingest.plan.deal import deal_units
from ingest.plan.units import UnitPlan

__all__ = ["StateInvalid", "StateRanges", "below", "count", "counter_map", "describe", "short"]


class StateInvalid(ValueError):
    """One field of a saved state out of its range."""


def count(value: Any, name: str, upper: int | None = None, what: str = "") -> int:
    """``value`` as a count in ``0..upper`` (inclusive; no upper bound when None)."""
    allowed = f"0..{upper}" if upper is not None else "an integer >= 0"
    if (isinstance(value, bool) or not isinstance(value, int) or value < 0
            or (upper is not None and value > upper)):
        raise StateInvalid(f"{name}={short(value, 60)} is outside {allowed}"
                           + (f" ({what})" if what else ""))
    return value


def below(value: Any, name: str, limit: int, what: str) -> int:
    """``value`` as an index in ``0..limit - 1`` (``0`` only when ``limit`` is 0)."""
    return count(value, name, max(limit - 1, 0), what)


def counter_map(value: Any, name: str, depth: int) -> None:
    """``{key: count}`` (depth 1) or ``{key: {key: count}}`` (depth 2) with counts >= 0."""
    if not isinstance(value, dict):
        raise StateInvalid(f"{name}={short(value, 60)} is not a JSON object of counts")
    for k, v in value.items():
        if depth > 1:
            counter_map(v, f"{name}[{k!r}]", depth - 1)
        else:
            count(v, f"{name}[{k!r}]")


def describe(x: Any) -> str:
    """What ``x`` is, for a message: a dict's keys, else its type."""
    if isinstance(x, dict):
        return f"a dict with keys {sorted(map(str, x))}"
    return f"a {type(x).__name__}"


def short(x: Any, limit: int = 200) -> str:
    """``repr(x)``, cut at ``limit`` characters."""
    s = repr(x)
    return s if len(s) <= limit else s[:limit] + "..."


class StateRanges:
    """The allowed range of a stream state's positions, from the config and the plan: the
    epochs of the run and the units each stream is dealt in each (computed once per epoch)."""

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
        """``value`` as an epoch of the run (any count when ``num_epochs`` is null)."""
        epochs = self.config.num_epochs
        if epochs is None:
            return count(value, name)
        return below(value, name, epochs, f"num_epochs={epochs}")
