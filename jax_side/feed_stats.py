"""The feed's statistics: the consumer's counters, the chunk source's, and the streams'.

``HostFeed.stats()`` joins three kinds: what the consumer received and how long it waited
(``FeedCounters``), what the chunk source did (its ``SourceStats``, kept by ``PoolStats`` when
it closes), and the counters the streams carry in their states (``stream_counters``:
documents, skips, truncations, a mixture's tokens per source).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ingest.materialize.replay import MaterializedPlan
from ingest.plan.build import UnitPlan
from ingest.stream.chunk import ChunkSource, SourceStats

__all__ = ["FeedCounters", "PoolStats", "steady_window_start", "stream_counters"]


def steady_window_start(steps: int) -> int | None:
    """The step that starts the steady window of a run of ``steps`` steps: the largest power
    of two at most ``steps / 2`` (None under 4 steps)."""
    if steps < 4:
        return None
    return 1 << ((steps // 2).bit_length() - 1)


class FeedCounters:
    """Consumer-side counters of a feed, over every pass (``HostFeed.counters``).

    Attributes:
      steps: batches delivered.
      passes: passes begun: 1 + restarts (``reset_after_epoch``).
      tokens: real tokens of the batches delivered.
      padding_rows: all-padding rows of the batches delivered (streams that ended).
      padding_tokens: padding tokens of the batches delivered.
      dropped_rows: real rows read but not delivered (``drop_remainder``).
      dropped_tokens: the real tokens of ``dropped_rows``.
      wait_s: seconds the consumer waited for batches, in all.
      wait_max_s: the longest of those waits.
      wait_after_first_s: seconds waited after the first batch (the stall).
      first_batch_time: ``time.perf_counter()`` when the first batch was delivered, or None.
      last_batch_time: the same for the last batch, or None.
    """

    def __init__(self):
        self.steps = 0
        self.passes = 1
        self.tokens = 0
        self.padding_rows = 0
        self.padding_tokens = 0
        self.dropped_rows = 0
        self.dropped_tokens = 0
        self.wait_s = 0.0
        self.wait_max_s = 0.0
        self.wait_after_first_s = 0.0
        self.first_batch_time: float | None = None
        self.last_batch_time: float | None = None
        # (time, tokens, wait after the first batch) when ``steps`` reaches each power of two:
        # the steady rate is taken over the later part of the run from these.
        self._marks: dict[int, tuple[float, int, float]] = {}

    def count_wait(self, waited: float) -> None:
        self.wait_s += waited
        self.wait_max_s = max(self.wait_max_s, waited)

    def count_batch(self, now: float, waited: float, tokens: int, padding_rows: int,
                     padding_tokens: int) -> None:
        """Counts a batch delivered at ``now`` after a wait of ``waited`` seconds."""
        if self.first_batch_time is None:
            self.first_batch_time = now
        else:
            self.wait_after_first_s += waited
        self.last_batch_time = now
        self.steps += 1
        self.tokens += tokens
        if self.steps & (self.steps - 1) == 0:
            self._marks[self.steps] = (now, self.tokens, self.wait_after_first_s)
        self.padding_rows += padding_rows
        self.padding_tokens += padding_tokens

    def count_dropped(self, rows: int, tokens: int) -> None:
        self.dropped_rows += rows
        self.dropped_tokens += tokens

    def volume_stats(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "padding_rows": self.padding_rows,
            "padding_tokens": self.padding_tokens,
            "dropped_rows": self.dropped_rows,
            "dropped_tokens": self.dropped_tokens,
        }

    def timing_stats(self) -> dict[str, Any]:
        span = ((self.last_batch_time or 0) - (self.first_batch_time or 0))
        return {
            "wait_s": self.wait_s,
            "wait_max_s": self.wait_max_s,
            "stall_fraction": (self.wait_after_first_s / span) if span > 0 else 0.0,
            "tokens_per_s": (self.tokens / span) if span > 0 else 0.0,
            **self._steady(),
        }

    def _steady(self) -> dict[str, Any]:
        """Rate and stall over the later part of the run: from step ``m``, the largest power
        of two at most half the steps, to the last step. From the first batch on, the rows
        made before it (a chunk of every stream) count in the rate but not in the time;
        past ``m`` they are spent in runs much longer than a chunk's steps, so this is the
        rate a long training job sees."""
        m = steady_window_start(self.steps)
        if m is None or m not in self._marks or self.last_batch_time is None:
            return {"steady_from_step": None, "steady_tokens_per_s": 0.0,
                    "steady_stall_fraction": 0.0}
        t, tokens, waited = self._marks[m]
        span = self.last_batch_time - t
        return {"steady_from_step": m,
                "steady_tokens_per_s": (self.tokens - tokens) / span if span > 0 else 0.0,
                "steady_stall_fraction": ((self.wait_after_first_s - waited) / span
                                          if span > 0 else 0.0)}


class PoolStats:
    """The chunk source's counters for ``stats()``: read from the running source, kept once
    it closes (a pass restarted, or the feed closed)."""

    def __init__(self):
        self._closed: SourceStats | None = None
        self._closed_at = 0.0

    def keep(self, source: ChunkSource) -> None:
        """Keeps the counters of ``source``, which is about to close."""
        self._closed, self._closed_at = source.stats(), time.perf_counter()

    def _now(self, source: ChunkSource | None) -> tuple[SourceStats, float]:
        """The counters of ``source`` (None: those kept, or none yet) and when they hold."""
        if source is not None:
            return source.stats(), time.perf_counter()
        return self._closed or SourceStats(), self._closed_at

    @staticmethod
    def _rates(counts: dict[Any, int], started_at: float, now: float) -> dict[str, float]:
        """Rows per second since the source started, keyed by worker or stream."""
        if not counts:
            return {}
        span = max(1e-9, now - started_at)
        return {str(k): round(v / span, 1) for k, v in counts.items()}

    def summary(self, source: ChunkSource | None, *, backend: str, workers: int,
                streams: int) -> dict[str, Any]:
        """The source's entries of ``stats()``; ``source``: the running chunk source, or None."""
        st, now = self._now(source)
        if backend != "ray":
            live = 0
        elif source is None and self._closed is None:
            live = min(workers, streams)  # before the pool starts: those it will start
        else:
            live = st.num_workers + st.num_pending
        return {
            # Ray workers, started or pending (autoscale and ``resize`` change it).
            "workers": live,
            # Of those, workers not started yet: the cluster has no CPU for them (yet).
            "pending_workers": st.num_pending if backend == "ray" else 0,
            "backend": backend,
            "restarts": st.restarts,
            # Times every worker was lost and the streams waited for a CPU, and how long.
            "cpu_waits": st.cpu_waits,
            "cpu_wait_s": st.cpu_wait_s,
            "object_store_bytes_bound": st.bytes_bound,
            "object_store_bytes_peak": st.bytes_peak,
            "rows_per_s_by_worker": self._rates(st.rows_by_worker, st.started_at, now),
            "rows_per_s_by_stream": self._rates(st.rows_by_stream, st.started_at, now),
            # Rows this process made itself while Ray started (actors.warm_start).
            "warm_start_rows": st.host_rows,
        }


def stream_counters(entries: dict[str, Any], plan: UnitPlan, num_sources: int) -> dict[str, Any]:
    """The streams' counters summed over ``entries`` (a host state's ``streams``): documents,
    skips, truncations, and with several sources the realized mixture."""
    skipped: dict[str, dict[str, int]] = {}
    skipped_units: dict[str, int] = {}
    documents = truncated_docs = truncated_tokens = 0
    mix_tokens = np.zeros(num_sources, np.int64)
    for st in entries.values():
        s = st["state"] or {}
        if s.get("kind") == "mixture":
            mix_tokens += s["tokens"]
        documents += st.get("documents", s.get("documents", 0))
        truncated_docs += s.get("truncated_documents", 0)
        truncated_tokens += s.get("truncated_tokens", 0)
        for reason, per_file in s.get("skipped", {}).items():
            for path, n in per_file.items():
                skipped.setdefault(reason, {}).setdefault(path, 0)
                skipped[reason][path] += n
        for path, n in s.get("skipped_units", {}).items():
            skipped_units[path] = skipped_units.get(path, 0) + n
    return {
        "documents": documents,
        # A materialized source replays rows: its streams count no documents.
        "documents_counted": not isinstance(plan, MaterializedPlan),
        "skipped_documents": skipped,
        "skipped_rows_of_bad_files": skipped_units,
        "skipped_files": [p for p, _, _ in plan.skipped_files],
        "truncated_documents": truncated_docs,
        "truncated_tokens": truncated_tokens,
        # Realized mixture: tokens per source and their shares (several sources only).
        "tokens_by_source": mix_tokens.tolist() if len(mix_tokens) > 1 else [],
        "source_proportions": ([round(float(x), 4) for x in mix_tokens / mix_tokens.sum()]
                               if len(mix_tokens) > 1 and mix_tokens.sum() else []),
    }
