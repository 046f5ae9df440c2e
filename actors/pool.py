"""The worker pool: places streams on workers and keeps a bounded FIFO of chunk requests per
stream.

The host holds the object refs, so it owns the chunks: a chunk already produced survives its
worker. Requests per stream are bounded by ``prefetch``, so object-store memory is bounded by
``streams x prefetch x chunk bytes``.

When a worker dies (or a call on it fails unexpectedly), the pool replaces it and reopens each
of its streams from the ``state_after`` of the last chunk received for that stream; requests
still in flight are issued again. Streams are deterministic, so no row is lost or repeated.
A stream that keeps failing at the same position stops the run with an error naming it.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import time
from typing import Any

import ray

from actors.metrics import HostMetrics
from actors.worker import StreamWorker, WorkerError
from ingest.config import Config
from ingest.errors import StreamError
from ingest.plan import UnitPlan
from ingest.stream import Chunk

__all__ = ["WorkerPool"]

log = logging.getLogger("ingest.pool")


class WorkerPool:
    """Ray workers producing chunks for the streams ``stream_ids``.

    Args:
      config: the validated config (``chunk_rows`` and ``prefetch`` are read here).
      plan: the unit plan, put in the object store once and shared by every worker.
      stream_ids: the streams this host owns.
      num_workers: actors to start (one CPU each); at most one per stream is useful.
      get_timeout_s: how long one chunk may take before the wait fails with an error.
    """

    def __init__(self, config: Config, plan: UnitPlan, stream_ids: list[int], *,
                 num_workers: int, get_timeout_s: float = 300.0):
        if num_workers <= 0:
            raise ValueError(f"workers={num_workers} must be positive")
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialized: call ray.init() (or use backend='local')")
        self._config = config
        self._stream_ids = list(stream_ids)
        # Requests in flight per stream, lowered to fit object_store_budget_mb.
        self._depth = config.requests_in_flight(len(self._stream_ids))
        self.bytes_bound = len(self._stream_ids) * (self._depth + 1) * config.chunk_bytes
        self.bytes_peak = 0
        self.metrics = HostMetrics()
        self.rows_by_stream: dict[int, int] = {s: 0 for s in self._stream_ids}
        self.rows_by_worker: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self.started_at = time.perf_counter()
        self._timeout = get_timeout_s
        self._plan_ref = ray.put(plan)
        n = min(num_workers, len(self._stream_ids))
        self._where: dict[int, ray.ObjectRef] = {}
        self._next_name = 0
        self._workers = [self._spawn() for _ in range(n)]
        self._placement = {s: self._workers[i % n] for i, s in enumerate(self._stream_ids)}
        self._queues: dict[int, collections.deque] = {s: collections.deque()
                                                      for s in self._stream_ids}
        self._exhausted: set[int] = set()
        # Where to reopen each stream if its worker dies: (state, rows to skip).
        self._resume: dict[int, tuple[dict[str, Any] | None, int]] = {}
        self._failures: dict[int, tuple[Any, int]] = {}  # stream -> (position, count)
        # Failures of one stream in a row with no chunk delivered between them: preemptions can
        # come back to back, a poison document fails every time.
        self.max_failures = 5
        self._target_workers: int | None = None
        self.chunks_received = 0
        self.restarts = 0
        self.resizes = 0
        self.wait_s = 0.0

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def open(self, states: dict[int, tuple[dict[str, Any] | None, int]]) -> None:
        """Opens every stream at ``(state, rows to skip)`` (None state: the beginning)."""
        self._resume.update(states)
        refs = [self._placement[s].open.remote(s, st, skip) for s, (st, skip) in states.items()]
        for out in _get(refs, self._timeout, "opening streams"):
            _raise_worker_error(out)
        # Every stream's first request before any second one: workers serve requests in order,
        # and the first step needs a chunk of every stream.
        for depth in range(1, self._depth + 1):
            for s in self._stream_ids:
                self._fill(s, depth)

    def _fill(self, s: int, depth: int | None = None) -> None:
        q = self._queues[s]
        while len(q) < (depth or self._depth) and s not in self._exhausted:
            q.append(self._placement[s].produce.remote(s, self._config.chunk_rows))

    def request_resize(self, n: int) -> None:
        """Asks for ``n`` workers; applied by the thread that calls ``next_chunk``, at its next
        call, so it is safe to call from any thread."""
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"resize to {n!r} workers: give a positive integer")
        self._target_workers = n

    def _apply_resize(self) -> None:
        n = min(self._target_workers, len(self._stream_ids))
        self._target_workers = None
        if n == len(self._workers):
            return
        load = {id(w): [] for w in self._workers}
        for t, w in self._placement.items():
            load[id(w)].append(t)
        moved: list[tuple[int, Any]] = []
        drop: list = []
        if n > len(self._workers):
            new = [self._spawn() for _ in range(n - len(self._workers))]
            self._workers += new
            for w in new:
                load[id(w)] = []
            # Take streams from the busiest workers until loads differ by at most one.
            while True:
                busiest = max(self._workers, key=lambda w: len(load[id(w)]))
                idlest = min(self._workers, key=lambda w: len(load[id(w)]))
                if len(load[id(busiest)]) - len(load[id(idlest)]) <= 1:
                    break
                t = load[id(busiest)].pop()
                load[id(idlest)].append(t)
                moved.append((t, idlest))
        else:
            keep, drop = self._workers[:n], self._workers[n:]
            for w in drop:
                for t in load[id(w)]:
                    idlest = min(keep, key=lambda k: len(load[id(k)]))
                    load[id(idlest)].append(t)
                    moved.append((t, idlest))
            self._workers = keep
        log.info("resizing the pool to %d workers: moving streams %s", n, [t for t, _ in moved])
        for t, w in moved:
            self._placement[t] = w
            self._queues[t].clear()
        refs = [w.open.remote(t, *self._resume[t]) for t, w in moved]
        for out in _get(refs, self._timeout, f"reopening streams {[t for t, _ in moved]}"):
            _raise_worker_error(out)
        for w in drop:
            ray.kill(w, no_restart=True)
        for t, _ in moved:
            if t not in self._exhausted:
                self._fill(t)
        self.resizes += 1

    def _spawn(self):
        name = f"w{self._next_name}"
        w = StreamWorker.remote(self._config, self._plan_ref, name)
        self._names[id(w)] = name
        self._next_name += 1
        # Asked first, so it is answered before any chunk request queues behind it.
        self._where[id(w)] = w.where.remote()
        return w

    def kill_random_worker(self, rng) -> str | None:
        """Fault injection: SIGKILLs a random worker's process (``ray.kill`` when it runs on
        another node). Safe from any thread; the pool notices the death like any other."""
        workers = list(self._workers)
        if not workers:
            return None
        w = workers[int(rng.integers(len(workers)))]
        try:
            pid, node = ray.get(self._where[id(w)], timeout=30)
        except (KeyError, ray.exceptions.RayError, TimeoutError):
            return None
        if node == ray.get_runtime_context().get_node_id():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return None
        else:
            ray.kill(w, no_restart=True)
        return f"pid {pid}"

    def next_chunk(self, s: int) -> Chunk:
        """The stream's next chunk, in order; keeps ``prefetch`` requests in flight."""
        if self._target_workers is not None:
            self._apply_resize()
        while True:
            q = self._queues[s]
            if not q:
                self._fill(s)
            ref = q.popleft()
            t0 = time.perf_counter()
            try:
                out = _get(ref, self._timeout, f"a chunk of stream {s}")
            except _WORKER_LOST as e:
                self._replace(self._placement[s], s, e)
                continue
            finally:
                waited = time.perf_counter() - t0
                self.wait_s += waited
                self.metrics.wait_s.inc(waited)
            if isinstance(out, WorkerError) and out.retryable:
                self._replace(self._placement[s], s, out)
                continue
            break
        _raise_worker_error(out)
        self.chunks_received += 1
        self._resume[s] = (out.state_after, 0)
        self._failures.pop(s, None)
        if out.exhausted:
            self._exhausted.add(s)
            # Requests already queued behind the last chunk return empty chunks; drop them.
            q.clear()
        else:
            self._fill(s)
        # An upper bound on what the host holds: every request queued, plus at most one chunk
        # per stream in its hands (the feed drops a chunk before asking for the next).
        held = sum(len(q) for q in self._queues.values()) + len(self._stream_ids)
        self.bytes_peak = max(self.bytes_peak, held * self._config.chunk_bytes)
        name = self._names.get(id(self._placement[s]), "?")
        self.rows_by_stream[s] += out.num_rows
        self.rows_by_worker[name] = self.rows_by_worker.get(name, 0) + out.num_rows
        tags = {"stream": str(s)}
        self.metrics.rows.inc(out.num_rows, tags=tags)
        self.metrics.queue_depth.set(len(q), tags=tags)
        self.metrics.held_bytes.set(held * self._config.chunk_bytes)
        return out

    def _replace(self, dead, s: int, cause: BaseException) -> None:
        """Replaces worker ``dead`` (which failed serving stream ``s``) and reopens its streams
        where the host last received them. A replacement that dies too is replaced again,
        within the same budget of failures without progress."""
        while True:
            self._count_failure(s, cause)
            log.warning("worker for stream %d failed (%s: %s); replacing it and reopening its "
                        "streams from the last chunk received", s, type(cause).__name__,
                        str(cause).splitlines()[0] if str(cause) else "")
            i = next((i for i, w in enumerate(self._workers) if w is dead), None)
            if i is None:
                return  # Already replaced while serving another of its streams.
            try:
                ray.kill(dead, no_restart=True)
            except Exception:  # noqa: BLE001 -- it may be gone already
                pass
            fresh = self._spawn()
            self._workers[i] = fresh
            self.restarts += 1
            self.metrics.restarts.inc()
            moved = [t for t, w in self._placement.items() if w is dead]
            for t in moved:
                self._placement[t] = fresh
                self._queues[t].clear()
            refs = [fresh.open.remote(t, *self._resume[t]) for t in moved]
            try:
                outs = _get(refs, self._timeout, f"reopening streams {moved} on a new worker")
            except _WORKER_LOST as e:
                dead, cause = fresh, e
                continue
            for out in outs:
                _raise_worker_error(out)
            for t in moved:
                if t not in self._exhausted:
                    self._fill(t)
            return

    def _count_failure(self, s: int, cause: BaseException) -> None:
        """Counts failures of stream ``s`` at its current position; too many stop the run."""
        position = json.dumps(self._resume[s][0], sort_keys=True)
        last, count = self._failures.get(s, (None, 0))
        count = count + 1 if last == position else 1
        self._failures[s] = (position, count)
        if count >= self.max_failures:
            st = self._resume[s][0] or {}
            raise StreamError(
                f"stream {s} failed {count} times at the same position (epoch "
                f"{st.get('epoch', 0)}, unit {st.get('unit', 0)}, document {st.get('doc', 0)}) "
                f"without delivering a chunk; last error: {type(cause).__name__}: {cause}",
                stream_id=s) from cause

    def inject_error(self, s: int, at_row: int) -> None:
        """Fault injection for tests: stream ``s``'s worker fails partway through the chunk that
        would emit row ``at_row`` (once). Pick a row past the requests already in flight."""
        self._placement[s].inject_error.remote(s, at_row)

    def close(self) -> None:
        for w in self._workers:
            ray.kill(w, no_restart=True)
        self._workers = []


# A lost worker, node or object, or an unexpected failure inside a call: all are retried by
# reopening the stream on a new worker. Bad input travels as a WorkerError value, not these.
_WORKER_LOST = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
                ray.exceptions.ObjectLostError, ray.exceptions.NodeDiedError,
                ray.exceptions.RayTaskError)


def _raise_worker_error(out) -> None:
    if isinstance(out, WorkerError):
        raise StreamError(str(out), stream_id=out.stream_id, worker=out.worker) from out.cause


def _get(refs, timeout: float, what: str):
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError as e:
        raise TimeoutError(f"waited {timeout:.0f} s for {what} from the Ray workers; check the "
                           f"cluster (`ray status`) and the worker logs") from e
