"""The worker pool: places streams on workers and keeps a bounded FIFO of chunk requests per
stream.

The host holds the object refs, so it owns the chunks: a chunk already produced survives its
worker. Requests per stream are bounded by ``prefetch``, so object-store memory is bounded by
``streams x prefetch x chunk bytes``.

The pool's parts, each in its own module:

- ``actors.placement``: how many workers start, which worker runs which streams, and the
  groups of streams one call serves (``streams_per_call``).
- ``actors.in_flight``: the requests in flight per stream and the replies taken from them.
- ``actors.recovery``: a dead worker replaced, its streams reopened where the host last
  received them; a stream failing again and again at one place stops the run.
- ``actors.orphans``: a replacement with no CPU to start on (a whole node lost) leaves its
  streams to the workers still running until it starts; the pool waits for a CPU only when
  none runs.
- ``actors.poison``: with ``on_bad_document: skip``, the document that kills workers located
  and skipped.
- ``actors.resize``: the worker count changed while running, on request or by autoscale.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from typing import Any

import ray

from actors.calls import WORKER_LOST, get_within, raise_worker_error
from actors.in_flight import InFlightRequests
from actors.metrics import HostMetrics
from actors.orphans import OrphanedStreams
from actors.placement import (
    group_streams,
    idle_workers,
    place_groups,
    pool_size,
    uneven_share,
)
from actors.poison import PoisonLocator
from actors.recovery import WorkerRecovery
from actors.resize import PoolResizing
from actors.worker import HOST_ENV, StreamWorker, WorkerError, actor_class
from ingest.chunk import SourceStats, StartAt
from ingest.config import Config
from ingest.plan import UnitPlan
from ingest.stream import Chunk

__all__ = ["WorkerPool"]

log = logging.getLogger("ingest.pool")

# The most of Ray's object store a worker prefaults as it starts (``prefault_object_store``):
# mapping pages costs the worker's CPU, so a bound keeps it to a fraction of a second.
PREFAULT_MAX_BYTES = 1 << 30


class WorkerPool(InFlightRequests, WorkerRecovery, OrphanedStreams, PoisonLocator, PoolResizing):
    """Ray workers producing chunks for the streams ``stream_ids``.

    Args:
      config: the validated config (``chunk_rows`` and ``prefetch`` are read here).
      plan: the unit plan, put in the object store once and shared by every worker.
      stream_ids: the streams this host owns.
      num_workers: actors to start (one CPU each); at most one per stream is useful.
      get_timeout_s: how long one chunk may take before the wait fails with an error; while
        no worker can run (no CPU), how often a warning says so (that wait has no deadline).
      worker_cls: the worker class, ``StreamWorker`` or a subclass of it (tests inject faults
        this way).
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
        # Requests in flight per stream, lowered to fit object_store_budget_mb.
        self._depth = config.requests_in_flight(len(self._stream_ids))
        self.bytes_bound = len(self._stream_ids) * (self._depth + 1) * config.chunk_bytes
        # Each worker maps this much of the store when it starts: the chunks land there.
        self._prefault_bytes = (min(self.bytes_bound * 5 // 4, PREFAULT_MAX_BYTES)
                                if config.prefault_object_store else 0)
        self.bytes_peak = 0
        self.metrics = HostMetrics()
        self.rows_by_stream: dict[int, int] = {s: 0 for s in self._stream_ids}
        self.rows_by_worker: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self.started_at = time.perf_counter()
        self._timeout = get_timeout_s
        self._plan = plan
        self._plan_ref = ray.put(plan)
        self._where: dict[int, ray.ObjectRef] = {}
        self._next_name = 0
        self._actor_cls = actor_class(worker_cls)
        self.poisoned = 0  # documents located as killing workers and skipped
        n = pool_size(config, num_workers, len(self._stream_ids))
        idle = None if config.autoscale else idle_workers(num_workers, len(self._stream_ids),
                                                          config.num_streams)
        if idle:
            log.warning("%s", idle)
        self._start_workers(n)
        self._place(n)
        # The result of the last grouped call fetched, which the group's other streams take
        # their chunks from next: (ref, chunks).
        self._fetched: tuple[Any, list] | None = None
        # Streams asked for alone until they deliver a chunk: those of a worker that died. A
        # grouped call that kills its worker fails every stream of the group, and the failures
        # must land on the stream whose document kills it (poison documents, _count_failure).
        self._solo: set[int] = set()
        self._queues: dict[int, collections.deque] = {s: collections.deque()
                                                      for s in self._stream_ids}
        self._exhausted: set[int] = set()
        # Where to reopen each stream if its worker dies: (state, rows to skip).
        self._resume: dict[int, tuple[dict[str, Any] | None, int]] = {}
        self._failures: dict[int, tuple[Any, int]] = {}  # stream -> (position, count)
        # Failures of one stream in a row with no chunk delivered between them: preemptions can
        # come back to back, a poison document fails every time.
        self.max_failures = 5
        self._start_autoscale(config)
        self.chunks_received = 0
        self.requests = 0  # actor calls for chunks: one per chunk, or per group of them
        self.restarts = 0
        # Times every worker was lost and the streams waited for a CPU, and the seconds.
        self.cpu_waits = 0
        self.cpu_wait_s = 0.0
        self.wait_s = 0.0

    def _start_workers(self, n: int) -> None:
        """Starts ``n`` workers; those the cluster has no CPU for yet wait as pending."""
        # Workers take one CPU each. Those beyond the cluster's CPUs start as pending, like a
        # resize's (a node may join; they take streams once they run): the streams open on
        # the workers that can run instead of waiting for all of them. The cluster's total,
        # not its free CPUs: those lag behind actors that were just killed.
        start_now = min(n, max(1, int(ray.cluster_resources().get("CPU", 0))))
        if start_now < n:
            log.warning("workers=%d, but the Ray cluster has %d CPU(s) and each worker takes "
                        "one: starting with %d, the other %d wait for a CPU (a node joining); "
                        "lower workers, or add CPUs (`ray start --num-cpus`, more nodes)",
                        n, start_now, start_now, n - start_now)
        self._workers = [self._spawn() for _ in range(n)]
        self._pending: list = []
        if start_now < n:
            # Ray starts actors in no set order: the first to start take the streams.
            refs = [self._where[id(w)] for w in self._workers]
            ready, _ = ray.wait(refs, num_returns=start_now, timeout=self._timeout)
            if not ready:
                for w in self._workers:
                    ray.kill(w, no_restart=True)
                raise TimeoutError(f"none of {n} workers started within {self._timeout:.0f} s: "
                                   f"check the cluster (`ray status`) and the worker logs")
            self._pending = [w for w in self._workers if self._where[id(w)] not in ready]
            self._workers = [w for w in self._workers if self._where[id(w)] in ready]

    def _place(self, n: int) -> None:
        """Groups the streams for a pool of ``n`` workers and places the groups on the
        workers running (``actors.placement``)."""
        config = self._config
        g = config.streams_per_call_on(len(self._stream_ids), n)
        self.streams_per_call = g  # reported: one call makes the chunks of this many streams
        if g != config.streams_per_call:
            log.info("streams_per_call=%d: this host's %d streams on %d workers (the config's "
                     "%d counts num_streams=%d on workers=%d)", g, len(self._stream_ids), n,
                     config.streams_per_call, config.num_streams, config.workers)
        self._group = group_streams(self._stream_ids, g)
        self._placement = place_groups(self._stream_ids, g, self._workers)
        uneven = uneven_share(self._placement, len(self._workers))
        if uneven:
            pace, why = uneven
            # A tenth of the workers' rate or more lost is worth a warning.
            log.log(logging.WARNING if pace < 0.9 * len(self._workers) else logging.INFO,
                    "%s", why)

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def open(self, states: dict[int, StartAt]) -> None:
        """Opens every stream at ``(state, rows to skip)`` (None state: the beginning). A
        worker lost meanwhile is replaced, and its streams reopened on the new one."""
        self._resume.update(states)
        asked = {s: self._placement[s] for s in states}
        refs = {s: w.open.remote(s, *states[s]) for s, w in asked.items()}
        for s, ref in refs.items():
            try:
                out = get_within(ref, self._timeout, f"opening stream {s}")
            except WORKER_LOST as e:
                self._replace(asked[s], s, e)
                continue
            raise_worker_error(out)
        # Every stream's first request before any second one: workers serve requests in order,
        # and the first step needs a chunk of every stream. (A first chunk of one step's rows
        # was tried: the first batch came no sooner, and the consumer then stalled on every
        # stream's next full chunk.)
        for depth in range(1, self._depth + 1):
            for s in self._stream_ids:
                self._fill(s, depth)

    def reopen(self, states: dict[int, StartAt]) -> None:
        """Drops every request in flight and opens the streams again at ``states``, on the
        workers already running (``reset_after_epoch`` restarts a pass this way)."""
        for q in self._queues.values():
            q.clear()
        self._fetched = None
        self._exhausted.clear()
        self._failures.clear()
        self.open(states)

    def _spawn(self):
        name = f"w{self._next_name}"
        w = self._actor_cls.remote(self._config, self._plan_ref, name,
                                   prefault_bytes=self._prefault_bytes,
                                   host_env={k: os.environ[k] for k in HOST_ENV
                                             if k in os.environ})
        self._names[id(w)] = name
        self._next_name += 1
        # Asked first, so it is answered before any chunk request queues behind it.
        self._where[id(w)] = w.where.remote()
        return w

    @property
    def workers(self) -> list:
        """The worker actors running now (not those still waiting for a CPU)."""
        return list(self._workers)

    @property
    def pending_workers(self) -> list:
        """The worker actors started but still waiting for a CPU."""
        return list(self._pending)

    def worker_of(self, s: int):
        """The worker actor stream ``s`` is placed on."""
        return self._placement[s]

    def location(self, w) -> ray.ObjectRef:
        """``(process id, Ray node id)`` of worker ``w`` (a ref, asked when it started)."""
        return self._where[id(w)]

    def next_chunk(self, s: int) -> Chunk:
        """The stream's next chunk, in order; keeps ``prefetch`` requests in flight."""
        if self._autoscale is not None:
            self._autoscale_step()
        if self._target_workers is not None:
            self._apply_resize()
        self._adopt_ready()
        out = self._receive(s)
        raise_worker_error(out)
        q = self._queues[s]
        self.chunks_received += 1
        self._solo.discard(s)
        self._resume[s] = (out.state_after, 0)
        self._failures.pop(s, None)
        if out.exhausted:
            self._exhausted.add(s)
            # Requests already queued behind the last chunk return empty chunks; drop them.
            q.clear()
        else:
            self._fill(s)
        self._count(s, out)
        return out

    def _receive(self, s: int) -> Any:
        """The reply to stream ``s``'s oldest request: a chunk, or a WorkerError that no new
        worker mends (bad input). A lost worker is replaced and the request made again."""
        while True:
            q = self._queues[s]
            if not q:
                self._fill(s, now=True)
            entry = q.popleft()
            t0 = time.perf_counter()
            try:
                out = self._take(entry, s)
            except WORKER_LOST as e:
                self._replace(self._placement[s], s, e)
                continue
            finally:
                waited = time.perf_counter() - t0
                self.wait_s += waited
                if waited > 0:
                    self.metrics.wait_s.inc(waited)
            if isinstance(out, WorkerError) and out.retryable:
                self._replace(self._placement[s], s, out)
                continue
            return out

    def _count(self, s: int, out: Chunk) -> None:
        """Counts a chunk of stream ``s`` received: rows per stream and worker, bytes held,
        and the metrics."""
        # An upper bound on what the host holds: every request queued, plus at most one chunk
        # per stream in its hands (the feed drops a chunk before asking for the next).
        held = sum(len(q) for q in self._queues.values()) + len(self._stream_ids)
        self.bytes_peak = max(self.bytes_peak, held * self._config.chunk_bytes)
        name = self._names.get(id(self._placement[s]), "?")
        self.rows_by_stream[s] += out.num_rows
        self.rows_by_worker[name] = self.rows_by_worker.get(name, 0) + out.num_rows
        tags = {"stream": str(s)}
        if out.num_rows:  # Ray's counters refuse zero increments
            self.metrics.rows.inc(out.num_rows, tags=tags)
        self.metrics.queue_depth.set(len(self._queues[s]), tags=tags)
        self.metrics.held_bytes.set(held * self._config.chunk_bytes)

    def stats(self) -> SourceStats:
        return SourceStats(
            num_workers=len(self._workers), num_pending=len(self._pending),
            restarts=self.restarts, resizes=self.resizes, poisoned=self.poisoned,
            cpu_waits=self.cpu_waits, cpu_wait_s=self.cpu_wait_s, bytes_bound=self.bytes_bound,
            bytes_peak=self.bytes_peak, chunks_received=self.chunks_received,
            requests=self.requests, wait_s=self.wait_s,
            rows_by_worker=dict(self.rows_by_worker), rows_by_stream=dict(self.rows_by_stream),
            started_at=self.started_at)

    def close(self) -> None:
        for w in self._workers + self._pending:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # noqa: BLE001 -- a worker lost already is gone either way
                pass
        self._workers, self._pending = [], []
