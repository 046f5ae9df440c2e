"""How many global steps a feed delivers: ``HostFeed.iterator_length``, for progress bars.

Step t (0-based) takes k_t = ``batch_size_at(t) / num_streams`` rows of every stream, so the
steps follow from each stream's rows (``steps_covering``). The rows are exact where no
tokenizing is needed to count them (a materialized directory's manifest; ``packing: none``
with ``long_documents: truncate``: one row per document), else estimated from the plan's text
bytes at the rows per byte the owned streams have produced so far::

    stream s: bytes of its units in every epoch x rows per byte seen = rows -> steps
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ingest.config import Config
from ingest.materialize.replay import MaterializedPlan
from ingest.plan.build import UnitPlan
from ingest.plan.deal import deal_units

__all__ = ["BYTES_PER_TOKEN", "DEALT_EPOCHS", "IteratorLength", "LengthEstimator",
           "steps_covering"]

# A prior for iterator_length before any row is seen: English prose runs about 4 bytes per
# token with the GPT-2 and cl100k BPEs (measured on the demo corpus: 3.6-4.3).
BYTES_PER_TOKEN = 4.0
# Epochs whose deals are computed for iterator_length; later epochs repeat them (deals balance
# bytes, so every epoch's per-stream bytes are alike), and the count is then an estimate.
DEALT_EPOCHS = 8


@dataclasses.dataclass(frozen=True)
class IteratorLength:
    """How many global steps the feed delivers, counted from step 0 (resumed steps included;
    with ``reset_after_epoch``, one pass).

    Attributes:
      steps: the count; None when the data never ends (``num_epochs: null``).
      exact: whether ``steps`` is certain; False marks an estimate.
      basis: how it was found, in words.
    """

    steps: int | None
    exact: bool
    basis: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def steps_covering(config: Config, rows: int, *, start: int = 0, full: bool = False) -> int:
    """Steps from step ``start`` (0-based) on that ``rows`` rows of one stream reach: the steps
    holding at least one of them, or with ``full`` the steps they fill completely
    (``ingest.batch_schedule.BatchSchedule.steps_covering``)."""
    return config.schedule.steps_covering(rows, start=start, full=full)


class LengthEstimator:
    """Counts a feed's global steps over ``plan`` (each stream's deals computed once).

    Args:
      config: the validated config.
      plan: the unit plan, or a materialized directory's (``ingest.materialize.replay``).
    """

    def __init__(self, config: Config, plan: UnitPlan):
        self.config = config
        self.plan = plan
        self._dealt: dict[str, Any] | None = None

    def length(self, streams: dict[str, Any], *, ended_at: int | None) -> IteratorLength:
        """The steps of the run (or of one pass with ``reset_after_epoch``), from step 0.

        Args:
          streams: the owned streams' entries of the host state delivered last.
          ended_at: the last step of a pass that has ended, else None.
        """
        c = self.config
        if c.num_epochs is None:
            return IteratorLength(None, True, "num_epochs is null: the data never ends")
        if ended_at is not None:
            return IteratorLength(ended_at, True, "this pass has ended")
        if isinstance(self.plan, MaterializedPlan):
            # A materialized directory (ingest.materialize.replay): its manifest counts every stream's rows.
            num_rows = self.plan.units.num_rows
            rows = np.array([num_rows[list(units)].sum() for units in self.plan.stream_units],
                            np.int64) * c.num_epochs
            exact, basis = True, "the materialized directory's rows, from its manifest"
        else:
            dealt = self._deals()
            exact_rows = (len(c.sources) == 1 and c.packing == "none"
                          and c.long_documents == "truncate" and c.on_bad_document == "error"
                          and c.on_bad_file == "error")
            if exact_rows:
                rows = dealt["docs"].sum(axis=0)
                basis = "packing none with long_documents truncate: one row per document"
                exact = dealt["exact"]
            else:
                rows, basis = self._estimated_rows(dealt, streams)
                exact = False
            if not dealt["exact"]:
                basis += f"; epochs past {DEALT_EPOCHS} assumed like the first {DEALT_EPOCHS}"
        if c.drop_remainder:
            steps = min(steps_covering(c, int(r), full=True) for r in rows)
        else:
            steps = max(steps_covering(c, int(r)) for r in rows)
        return IteratorLength(steps, exact, basis if exact else "estimate: " + basis)

    def _deals(self) -> dict[str, Any]:
        """Each stream's units, bytes and documents per epoch (cached)."""
        if self._dealt is None:
            c = self.config
            epochs = min(c.num_epochs, DEALT_EPOCHS)
            nbytes, ndocs = self.plan.units.nbytes, self.plan.units.num_rows
            units = [deal_units(self.plan, num_streams=c.num_streams, seed=c.seed, epoch=e,
                                shuffle=c.shuffle, deal=c.deal) for e in range(epochs)]
            reps = [units[e % epochs] for e in range(c.num_epochs)]
            self._dealt = {
                "units": units,
                "bytes": np.array([[nbytes[u].sum() for u in per] for per in reps], np.float64),
                "docs": np.array([[ndocs[u].sum() for u in per] for per in reps], np.int64),
                "exact": epochs == c.num_epochs,
                "nbytes": nbytes, "ndocs": ndocs,
            }
        return self._dealt

    def _estimated_rows(self, dealt: dict[str, Any],
                        streams: dict[str, Any]) -> tuple[np.ndarray, str]:
        """Rows each stream gives in all: known for exhausted owned streams, else its bytes
        times the rows per byte seen on this host's streams."""
        c = self.config
        total_bytes = dealt["bytes"].sum(axis=0)
        known: dict[int, int] = {}
        seen_rows = seen_bytes = 0.0
        for sid, entry in streams.items():
            st = entry["state"]
            if not st or len(c.sources) > 1 or not {"epoch", "unit", "doc"} <= set(st):
                continue  # nothing read yet, or a mixture's state (not one unit cursor)
            s = int(sid)
            if st.get("exhausted"):
                known[s] = int(st["rows_emitted"])
            e, u = int(st["epoch"]), int(st["unit"])
            units = dealt["units"][e % len(dealt["units"])][s]
            passed = dealt["bytes"][:e, s].sum() + dealt["nbytes"][units[:u]].sum()
            if u < len(units):
                uid = units[u]
                passed += dealt["nbytes"][uid] * min(1.0, int(st["doc"]) / dealt["ndocs"][uid])
            if st.get("exhausted"):
                passed = total_bytes[s]
            seen_rows += int(st["rows_emitted"])
            seen_bytes += float(passed)
        if seen_rows and seen_bytes:
            rate = seen_rows / seen_bytes
            basis = (f"plan text bytes x {rate * c.seq_len:.3f} tokens per byte seen in "
                     f"{int(seen_rows)} rows so far")
        else:
            rate = 1.0 / (BYTES_PER_TOKEN * c.seq_len)
            basis = f"plan text bytes at {BYTES_PER_TOKEN:g} bytes per token (no rows seen yet)"
        rows = np.array([known.get(s, math.ceil(total_bytes[s] * rate))
                         for s in range(c.num_streams)])
        return rows, basis
