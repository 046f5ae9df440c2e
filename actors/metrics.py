"""Feed metrics, exported through Ray's metrics API (Ray dashboard, Prometheus).

Names are prefixed ``ingest_``. Host side: rows and chunks received per stream, queue depth per
stream, consumer wait, worker restarts, object-store bytes held. Worker side: rows produced and
busy seconds per worker. The same figures (as totals and rates) are in ``HostFeed.stats()`` and
the CLI summary.
"""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge

__all__ = ["HostMetrics", "WorkerMetrics"]


class HostMetrics:
    """Metrics recorded by the host's pool."""

    def __init__(self):
        self.rows = Counter("ingest_rows_received", description="rows received, per stream",
                            tag_keys=("stream",))
        self.queue_depth = Gauge("ingest_queue_depth",
                                 description="chunk requests queued, per stream",
                                 tag_keys=("stream",))
        self.wait_s = Counter("ingest_chunk_wait_seconds",
                              description="time the host waited for chunks")
        self.restarts = Counter("ingest_worker_restarts", description="workers replaced")
        self.held_bytes = Gauge("ingest_object_store_bytes",
                                description="object-store bytes held by the host (upper bound)")


class WorkerMetrics:
    """Metrics recorded inside a worker actor."""

    def __init__(self, name: str):
        self._tags = {"worker": name}
        self.rows = Counter("ingest_worker_rows", description="rows produced, per worker",
                            tag_keys=("worker",))
        self.busy_s = Counter("ingest_worker_busy_seconds",
                              description="time spent producing chunks, per worker",
                              tag_keys=("worker",))

    def record(self, rows: int, seconds: float) -> None:
        # Ray's counters refuse zero increments (the empty chunk at a stream's end has 0 rows).
        if rows > 0:
            self.rows.inc(rows, tags=self._tags)
        if seconds > 0:
            self.busy_s.inc(seconds, tags=self._tags)
