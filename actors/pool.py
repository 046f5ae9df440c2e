"""The worker pool: places streams on workers and keeps a bounded FIFO of chunk requests per
stream.

The host holds the object refs, so it owns the chunks: a chunk already produced survives its
worker. Requests per stream are bounded by ``prefetch``, so object-store memory is bounded by
``streams x prefetch x chunk bytes``.

``WorkerPool`` holds its parts and calls them; each part is a plain object in its own module:

- ``placement``: the workers (running and pending) and which runs which streams, grouped by
  ``streams_per_call`` (``actors.placement.Placement``).
- ``in_flight``: the requests in flight per stream and the replies taken from them
  (``actors.in_flight.InFlightRequests``).
- ``recovery``: where each stream reopens; a dead worker replaced and its streams reopened
  where the host last received them, on the workers still running while its replacement
  waits for a CPU (``actors.orphans``); a stream failing again and again at one place stops
  the run (``actors.recovery.WorkerRecovery``).
- ``poison``: with ``on_bad_document: skip``, the document that kills workers located and
  skipped (``actors.poison.PoisonLocator``).
- ``resizing``: the worker count changed while running, on request or by autoscale
  (``actors.resize.PoolResizing``).
"""

from __future__ import annotations

import logging
import time

import ray

from actors.calls import WORKER_LOST, get_within, raise_worker_error
from actors.in_flight import InFlightRequests
from actors.metrics import HostMetrics
from actors.placement import Placement, idle_workers, pool_size
from actors.poison import PoisonLocator
from actors.recovery import WorkerRecovery
from actors.resize import PoolResizing
from actors.worker import StreamWorker, WorkerError
from ingest.config import Config
from ingest.plan.build import UnitPlan
from ingest.runtime import resolve_runtime
from ingest.stream.chunk import SourceStats, StartAt
from ingest.stream.kinds import Chunk

__all__ = ["WorkerPool"]

log = logging.getLogger("ingest.pool")

# The most of Ray's object store a worker prefaults as it starts (``prefault_object_store``):
# mapping pages costs the worker's CPU, so a bound keeps it to a fraction of a second.
PREFAULT_MAX_BYTES = 1 << 30


class WorkerPool:
    """Ray workers producing chunks for the streams ``stream_ids`` (an
    ``ingest.stream.chunk.ChunkSource``).

    Args:
      config: the validated config (its runtime options resolved here:
        ``ingest.runtime.resolve_runtime``).
      plan: the unit plan, put in the object store once and shared by every worker.
      stream_ids: the streams this host owns.
      num_workers: actors to start (one CPU each); at most one per stream is useful.
      get_timeout_s: how long one chunk may take before the wait fails with an error; while
        no worker can run (no CPU), how often a warning says so (that wait has no deadline).
      worker_cls: the worker class, ``StreamWorker`` or a subclass of it (tests inject faults
        this way).

    Attributes:
      placement, in_flight, recovery, poison, resizing: the parts (see the module).
      bytes_bound: the object-store bytes the host may hold at most.
      chunks_received: chunks handed out.
    """

    def __init__(self, config: Config, plan: UnitPlan, stream_ids: list[int], *,
                 num_workers: int, get_timeout_s: float = 300.0,
                 worker_cls: type[StreamWorker] = StreamWorker):
        if num_workers <= 0:
            raise ValueError(f"workers={num_workers} must be positive")
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialized: call ray.init() (or use backend='local')")
        self._config = config
        self._stream_ids = list(stream_ids)
        self._timeout = get_timeout_s
        runtime = resolve_runtime(config)
        self._chunk_bytes = runtime.chunk_bytes
        # Requests in flight per stream, lowered to fit object_store_budget_mb.
        depth = runtime.requests_in_flight(len(self._stream_ids))
        self.bytes_bound = len(self._stream_ids) * (depth + 1) * runtime.chunk_bytes
        self._bytes_peak = 0
        self._metrics = HostMetrics()
        self._rows_by_stream: dict[int, int] = {s: 0 for s in self._stream_ids}
        self._rows_by_worker: dict[str, int] = {}
        self._started_at = time.perf_counter()
        self._wait_s = 0.0
        self.chunks_received = 0
        n = pool_size(config, num_workers, len(self._stream_ids))
        idle = None if config.runtime.autoscale else idle_workers(num_workers, len(self._stream_ids),
                                                          config.num_streams)
        if idle:
            log.warning("%s", idle)
        # Each worker maps this much of the store when it starts: the chunks land there.
        prefault = (min(self.bytes_bound * 5 // 4, PREFAULT_MAX_BYTES)
                    if config.runtime.prefault_object_store else 0)
        self.placement = Placement(config, ray.put(plan), self._stream_ids, runtime=runtime,
                                   worker_cls=worker_cls, prefault_bytes=prefault,
                                   timeout_s=get_timeout_s)
        self.placement.start(n)
        self.in_flight = InFlightRequests(self.placement, self._stream_ids,
                                          chunk_rows=runtime.chunk_rows, depth=depth,
                                          timeout_s=get_timeout_s)
        self.poison = PoisonLocator(config, plan, self.placement, chunk_rows=runtime.chunk_rows,
                                    timeout_s=get_timeout_s)
        self.recovery = WorkerRecovery(config, plan, self.placement, self.in_flight,
                                       self.poison, self._metrics, timeout_s=get_timeout_s)
        self.resizing = PoolResizing(config, self.placement, self.recovery, self.in_flight,
                                     len(self._stream_ids))

    # -- the ChunkSource contract ---------------------------------------------------------

    def open(self, states: dict[int, StartAt]) -> None:
        """Opens every stream at ``(state, rows to skip)`` (None state: the beginning). A
        worker lost meanwhile is replaced, and its streams reopened on the new one."""
        self.recovery.start_at(states)
        asked = {s: self.placement.worker_of(s) for s in states}
        refs = {s: w.open.remote(s, *states[s]) for s, w in asked.items()}
        for s, ref in refs.items():
            try:
                out = get_within(ref, self._timeout, f"opening stream {s}")
            except WORKER_LOST as e:
                self.recovery.replace(asked[s], s, e)
                continue
            raise_worker_error(out)
        # Every stream's first request before any second one: workers serve requests in order,
        # and the first step needs a chunk of every stream. (A first chunk of one step's rows
        # was tried: the first batch came no sooner, and the consumer then stalled on every
        # stream's next full chunk.)
        for depth in range(1, self.in_flight.depth + 1):
            for s in self._stream_ids:
                self.in_flight.fill(s, depth)

    def reopen(self, states: dict[int, StartAt]) -> None:
        """Drops every request in flight and opens the streams again at ``states``, on the
        workers already running (``reset_after_epoch`` restarts a pass this way)."""
        self.in_flight.drop_all()
        self.recovery.forget_failures()
        self.open(states)

    def next_chunk(self, s: int) -> Chunk:
        """The stream's next chunk, in order; keeps ``prefetch`` requests in flight."""
        self.resizing.before_chunk(self._wait_s)
        out = self._receive(s)
        raise_worker_error(out)
        self.chunks_received += 1
        self.recovery.received(s, out.state_after)
        self.in_flight.delivered(s, out.exhausted)
        self._count(s, out)
        return out

    def request_resize(self, n: int) -> None:
        """Asks for ``n`` workers; applied at the next ``next_chunk``, so it is safe to call
        from any thread."""
        self.resizing.request(n)

    def stats(self) -> SourceStats:
        place = self.placement
        return SourceStats(
            num_workers=len(place.workers), num_pending=len(place.pending),
            restarts=self.recovery.restarts, resizes=self.resizing.resizes,
            poisoned=self.poison.poisoned, cpu_waits=self.recovery.cpu_waits,
            cpu_wait_s=self.recovery.cpu_wait_s, bytes_bound=self.bytes_bound,
            bytes_peak=self._bytes_peak, chunks_received=self.chunks_received,
            requests=self.in_flight.requests, wait_s=self._wait_s,
            rows_by_worker=dict(self._rows_by_worker),
            rows_by_stream=dict(self._rows_by_stream), started_at=self._started_at)

    def close(self) -> None:
        self.placement.close()

    # -- the workers ----------------------------------------------------------------------

    @property
    def num_workers(self) -> int:
        return len(self.placement.workers)

    @property
    def num_pending(self) -> int:
        """Workers asked for but not started yet (waiting for a CPU, e.g. on Ray's autoscaler)."""
        return len(self.placement.pending)

    @property
    def workers(self) -> list:
        """The worker actors running now (not those still waiting for a CPU)."""
        return list(self.placement.workers)

    @property
    def pending_workers(self) -> list:
        """The worker actors started but still waiting for a CPU."""
        return list(self.placement.pending)

    @property
    def streams_per_call(self) -> int:
        """The streams one call makes chunks of."""
        return self.placement.streams_per_call

    def location(self, w) -> ray.ObjectRef:
        """``(process id, Ray node id)`` of worker ``w`` (a ref, asked when it started)."""
        return self.placement.location(w)

    # -- inside ---------------------------------------------------------------------------

    def _receive(self, s: int) -> Chunk | WorkerError:
        """The reply to stream ``s``'s oldest request: a chunk, or a WorkerError that no new
        worker mends (bad input). A lost worker is replaced and the request made again."""
        while True:
            w = self.placement.worker_of(s)
            t0 = time.perf_counter()
            try:
                out = self.in_flight.next_reply(s)
            except WORKER_LOST as e:
                self.recovery.replace(w, s, e)
                continue
            finally:
                waited = time.perf_counter() - t0
                self._wait_s += waited
                if waited > 0:
                    self._metrics.wait_s.inc(waited)
            if isinstance(out, WorkerError) and out.retryable:
                self.recovery.replace(w, s, out)
                continue
            return out

    def _count(self, s: int, out: Chunk) -> None:
        """Counts a chunk of stream ``s`` received: rows per stream and worker, bytes held,
        and the metrics."""
        # An upper bound on what the host holds: every request queued, plus at most one chunk
        # per stream in its hands (the feed drops a chunk before asking for the next).
        held = self.in_flight.total() + len(self._stream_ids)
        chunk_bytes = self._chunk_bytes
        self._bytes_peak = max(self._bytes_peak, held * chunk_bytes)
        name = self.placement.name_of(self.placement.worker_of(s))
        self._rows_by_stream[s] += out.num_rows
        self._rows_by_worker[name] = self._rows_by_worker.get(name, 0) + out.num_rows
        tags = {"stream": str(s)}
        if out.num_rows:  # Ray's counters refuse zero increments
            self._metrics.rows.inc(out.num_rows, tags=tags)
        self._metrics.queue_depth.set(self.in_flight.queued(s), tags=tags)
        self._metrics.held_bytes.set(held * chunk_bytes)
