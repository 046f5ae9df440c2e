"""The worker pool: places streams on workers and keeps a bounded FIFO of chunk requests per
stream.

The host holds the object refs, so it owns the chunks: a chunk already produced survives its
worker. Requests per stream are bounded by ``prefetch``, so object-store memory is bounded by
``streams x prefetch x chunk bytes``.

When a worker dies (or a call on it fails unexpectedly), the pool replaces it and reopens each
of its streams from the ``state_after`` of the last chunk received for that stream; requests
still in flight are issued again. Streams are deterministic, so no row is lost or repeated.
A stream that keeps failing at the same position stops the run with an error naming it.
A replacement with no CPU to start on (a whole node lost) leaves its streams to the workers
still running until it starts, and the pool waits for a CPU only when none runs
(``actors.orphans``).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from typing import Any

import ray

from actors import orphans
from actors.autoscale import AutoscalePolicy
from actors.faults import WorkerFaults
from actors.mailbox import Mailbox
from actors.metrics import HostMetrics
from actors.worker import HOST_ENV, StreamWorker, WorkerError
from ingest.config import Config
from ingest.errors import StreamError
from ingest.plan import UnitPlan
from ingest.stream import Chunk, open_stream

__all__ = ["WorkerPool"]

log = logging.getLogger("ingest.pool")

# The most of Ray's object store a worker prefaults as it starts (``prefault_object_store``):
# mapping a page takes its process 1 - 2.4 us, so at most about half a second of a CPU.
PREFAULT_MAX_BYTES = 1 << 30


class WorkerPool:
    """Ray workers producing chunks for the streams ``stream_ids``.

    Args:
      config: the validated config (``chunk_rows`` and ``prefetch`` are read here).
      plan: the unit plan, put in the object store once and shared by every worker.
      stream_ids: the streams this host owns.
      num_workers: actors to start (one CPU each); at most one per stream is useful.
      get_timeout_s: how long one chunk may take before the wait fails with an error; while
        no worker can run (no CPU), how often a warning says so (that wait has no deadline).
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
        n = min(num_workers, len(self._stream_ids))
        if config.autoscale:
            n = max(config.min_workers, min(config.max_workers or n, n))
            n = min(n, len(self._stream_ids))
        self._where: dict[int, ray.ObjectRef] = {}
        self._next_name = 0
        self.worker_faults = WorkerFaults()  # given to every worker started (actors.faults)
        self.poisoned = 0  # documents located as killing workers and skipped
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
            start_now = len(self._workers)
        # Groups of streams_per_call consecutive streams, each group on one worker: one call
        # makes the next chunk of every stream of a group (fewer calls and objects). At most
        # a worker's share of the streams, so that every worker gets a group; left null in the
        # config, exactly that share.
        share = len(self._stream_ids) // n
        g = max(1, share if config.is_auto("streams_per_call")
                else min(config.streams_per_call, share))
        self._group = {s: tuple(self._stream_ids[i - i % g:i - i % g + g])
                       for i, s in enumerate(self._stream_ids)}
        self._placement = {s: self._workers[(i // g) % start_now]
                           for i, s in enumerate(self._stream_ids)}
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
        self._target_workers: int | None = None
        self._autoscale: AutoscalePolicy | None = None
        if config.autoscale:
            self._autoscale = AutoscalePolicy(
                min_workers=min(config.min_workers, len(self._stream_ids)),
                max_workers=min(config.max_workers or len(self._stream_ids),
                                len(self._stream_ids)),
                window_s=config.autoscale_window_s)
            self._scale_mark = (time.perf_counter(), 0.0)
        self.chunks_received = 0
        self.requests = 0  # actor calls for chunks: one per chunk, or per group of them
        self.restarts = 0
        # Times every worker was lost and the streams waited for a CPU, and the seconds.
        self.cpu_waits = 0
        self.cpu_wait_s = 0.0
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
        # and the first step needs a chunk of every stream. (A first chunk of one step's rows
        # was tried: the first batch came no sooner beyond the noise, and the consumer then
        # stalled on every stream's next full chunk: 12-20% stall against 1-6%.)
        for depth in range(1, self._depth + 1):
            for s in self._stream_ids:
                self._fill(s, depth)

    def reopen(self, states: dict[int, tuple[dict[str, Any] | None, int]]) -> None:
        """Drops every request in flight and opens the streams again at ``states``, on the
        workers already running (``reset_after_epoch`` restarts a pass this way)."""
        for q in self._queues.values():
            q.clear()
        self._fetched = None
        self._exhausted.clear()
        self._failures.clear()
        self.open(states)

    def _fill(self, s: int, depth: int | None = None, *, now: bool = False) -> None:
        """Requests chunks of stream ``s`` until ``depth`` are in flight.

        Queue entries are ``(ref, i)``: the chunk, or (``i`` not None) the i-th chunk of a
        grouped call. A grouped call covers the streams of ``s``'s group on its worker that
        need a chunk. The feed takes rows of every stream at the same pace, so a group's
        streams run out of chunks at the same step, one after another: while another stream
        of the group still holds its full queue, ``s`` leaves the request to it, unless ``now``
        (``s`` needs a chunk at once).
        """
        depth = depth or self._depth
        q = self._queues[s]
        w = self._placement[s]
        rows = self._config.chunk_rows
        while len(q) < depth and s not in self._exhausted:
            if len(self._group[s]) == 1 or s in self._solo:
                self.requests += 1
                q.append((w.produce.remote(s, rows), None))
                continue
            members = [t for t in self._group[s] if self._placement[t] is w
                       and t not in self._exhausted and t not in self._solo]
            need = [t for t in members if len(self._queues[t]) < depth]
            if len(need) < len(members) and not now:
                return
            self.requests += 1
            ref = w.produce_many.remote(need, rows)
            for i, t in enumerate(need):
                self._queues[t].append((ref, i))
            now = False  # the rest may wait for the group again

    def _take(self, entry, s: int) -> Any:
        """The chunk (or WorkerError) a queue entry of stream ``s`` names."""
        ref, i = entry
        if i is None:
            return _get(ref, self._timeout, f"a chunk of stream {s}")
        if self._fetched is None or self._fetched[0] != ref:
            self._fetched = (ref, list(_get(ref, self._timeout, f"a chunk of stream {s}")))
        chunks = self._fetched[1]
        out, chunks[i] = chunks[i], None  # held by the feed from here on, not by this cache
        if all(c is None for c in chunks):
            self._fetched = None
        return out

    def request_resize(self, n: int) -> None:
        """Asks for ``n`` workers; applied by the thread that calls ``next_chunk``, at its next
        call, so it is safe to call from any thread."""
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"resize to {n!r} workers: give a positive integer")
        self._target_workers = n

    def _autoscale_step(self) -> None:
        """Applies the autoscale policy once per window (on the next_chunk thread)."""
        now = time.perf_counter()
        since, waited_before = self._scale_mark
        if now - since < self._autoscale.window_s:
            return
        self._scale_mark = (now, self.wait_s)
        queued = list(dict.fromkeys(ref for q in self._queues.values() for ref, _ in q))
        ready = len(ray.wait(queued, num_returns=len(queued), timeout=0)[0]) if queued else 0
        current = len(self._workers) + len(self._pending)
        target = self._autoscale.decide(
            workers=current, wait_fraction=(self.wait_s - waited_before) / (now - since),
            ready_fraction=ready / len(queued) if queued else 1.0)
        if target != current:
            log.info("autoscale: %d -> %d workers", current, target)
            self._target_workers = target

    @property
    def num_pending(self) -> int:
        """Workers asked for but not started yet (waiting for a CPU, e.g. on Ray's autoscaler)."""
        return len(self._pending)

    def _apply_resize(self) -> None:
        n = min(self._target_workers, len(self._stream_ids))
        self._target_workers = None
        have = len(self._workers) + len(self._pending)
        if n == have:
            return
        self.resizes += 1
        if n > have:
            # New workers take streams only once they have started: a worker still waiting for
            # a CPU (Ray's autoscaler adding a node, say) must never stall a stream.
            self._pending += [self._spawn() for _ in range(n - have)]
            log.info("growing the pool to %d workers (%d starting)", n, len(self._pending))
            self._adopt_ready()
            return
        while self._pending and len(self._workers) + len(self._pending) > n:
            ray.kill(self._pending.pop(), no_restart=True)
        if len(self._workers) <= n:
            return
        keep, drop = self._workers[:n], self._workers[n:]
        load = self._load()
        moves = []
        for w in drop:
            for t in load[id(w)]:
                idlest = min(keep, key=lambda k: len(load[id(k)]))
                load[id(idlest)].append(t)
                moves.append((t, idlest))
        self._workers = keep
        log.info("shrinking the pool to %d workers: moving streams %s", n, [t for t, _ in moves])
        self._move(moves)
        for w in drop:
            ray.kill(w, no_restart=True)

    def _load(self) -> dict[int, list[int]]:
        load: dict[int, list[int]] = {id(w): [] for w in self._workers}
        for t, w in self._placement.items():
            load[id(w)].append(t)
        return load

    def _adopt_ready(self) -> None:
        """Moves streams onto pending workers that have started, evening out the load."""
        if not self._pending:
            return
        up, died = orphans.sort_started([self._where[id(w)] for w in self._pending], 0)
        started = [self._pending[i] for i in up]
        lost = [self._pending[i] for i in died]
        self._pending = [w for i, w in enumerate(self._pending) if i not in up + died]
        self._respawn(lost)
        if not started:
            return
        self._workers += started
        load = self._load()
        moves = []
        while True:
            busiest = max(self._workers, key=lambda w: len(load[id(w)]))
            idlest = min(self._workers, key=lambda w: len(load[id(w)]))
            if len(load[id(busiest)]) - len(load[id(idlest)]) <= 1:
                break
            t = load[id(busiest)].pop()
            load[id(idlest)].append(t)
            moves.append((t, idlest))
        log.info("%d new worker(s) started: moving streams %s", len(started),
                 [t for t, _ in moves])
        self._move(moves)

    def _move(self, moves: list[tuple[int, Any]]) -> None:
        """Reopens streams on other (started) workers from the last chunk received."""
        for t, w in moves:
            self._placement[t] = w
            self._queues[t].clear()
        refs = [w.open.remote(t, *self._resume[t]) for t, w in moves]
        for (t, w), ref in zip(moves, refs, strict=True):
            try:
                _raise_worker_error(_get(ref, self._timeout, f"reopening stream {t}"))
            except _WORKER_LOST as e:
                self._replace(w, t, e)
        for t, _ in moves:
            if t not in self._exhausted:
                self._fill(t)

    def _spawn(self):
        name = f"w{self._next_name}"
        w = StreamWorker.remote(self._config, self._plan_ref, name,
                                prefault_bytes=self._prefault_bytes,
                                host_env={k: os.environ[k] for k in HOST_ENV if k in os.environ})
        if self.worker_faults:
            w.set_faults.remote(self.worker_faults)
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
        while True:
            q = self._queues[s]
            if not q:
                self._fill(s, now=True)
            entry = q.popleft()
            t0 = time.perf_counter()
            try:
                out = self._take(entry, s)
            except _WORKER_LOST as e:
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
            break
        _raise_worker_error(out)
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
            self.restarts += 1
            self.metrics.restarts.inc()
            moved = [t for t, w in self._placement.items() if w is dead]
            self._solo.update(moved)
            if not orphans.started(self._where[id(fresh)], orphans.REPLACEMENT_START_S):
                # No CPU for it (a lost node took it): it waits as a pending worker.
                del self._workers[i]
                self._pending.append(fresh)
                self._rehome(moved)
                return
            self._workers[i] = fresh
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

    def _rehome(self, moved: list[int]) -> None:
        """Reopens the streams ``moved`` of a lost worker on the workers still running, the
        least loaded first; when none runs, first waits for a pending one to start."""
        if not self._workers:
            self._wait_for_a_worker(moved)
        load = {id(w): [] for w in self._workers}
        for t, w in self._placement.items():
            if t not in moved:
                load[id(w)].append(t)
        by_id = {id(w): w for w in self._workers}
        moves = [(t, by_id[k]) for t, k in orphans.spread(moved, load)]
        log.warning("no CPU for a replacement worker yet: moving streams %s to the %d worker(s) "
                    "running; the replacement takes its share once it starts", moved,
                    len(self._workers))
        self._move(moves)

    def _wait_for_a_worker(self, streams: list[int]) -> None:
        """Waits, without a deadline, until a pending worker starts (a node joins or comes
        back), replacing those that die before they start; a warning every get_timeout_s,
        counted in ``cpu_waits`` and ``cpu_wait_s``."""
        t0 = time.perf_counter()
        self.cpu_waits += 1
        log.warning("no worker runs and no CPU is free for the %d replacement(s): streams %s "
                    "wait for one to start (a Ray node must join or come back; see `ray status`)",
                    len(self._pending), streams)
        while not self._workers:
            up, died = orphans.sort_started([self._where[id(w)] for w in self._pending],
                                            self._timeout)
            self._workers = [self._pending[i] for i in up]
            lost = [self._pending[i] for i in died]
            self._pending = [w for i, w in enumerate(self._pending) if i not in up + died]
            for w in lost:
                self._count_failure(streams[0], RuntimeError(
                    f"worker {self._names.get(id(w), '?')} died before it started"))
            self._respawn(lost)
            if not (up or died):
                log.warning("still no CPU for a worker after %.0f s: streams %s wait (not an "
                            "error; the run goes on once a node joins or comes back; see `ray "
                            "status`)", time.perf_counter() - t0, streams)
        waited = time.perf_counter() - t0
        self.cpu_wait_s += waited
        log.warning("a worker started after %.0f s without a CPU: streams %s go on", waited,
                    streams)

    def _respawn(self, lost: list) -> None:
        """Starts a pending worker in place of each of ``lost``, pending workers that died
        before they started (counted as restarts)."""
        for w in lost:
            log.warning("worker %s died before it started (its node lost?); starting another",
                        self._names.pop(id(w), "?"))
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # noqa: BLE001 -- it is gone already
                pass
            self._pending.append(self._spawn())
            self.restarts += 1
            self.metrics.restarts.inc()

    def _count_failure(self, s: int, cause: BaseException) -> None:
        """Counts failures of stream ``s`` at its current position; too many stop the run,
        unless ``on_bad_document: skip`` and the failures are a document that kills its
        worker, which is then located and skipped."""
        position = json.dumps(self._resume[s], sort_keys=True)
        last, count = self._failures.get(s, (None, 0))
        count = count + 1 if last == position else 1
        self._failures[s] = (position, count)
        if count >= self.max_failures and self._config.on_bad_document == "skip":
            if self._skip_poison(s):
                return
        if count >= self.max_failures:
            raise StreamError(
                f"stream {s} failed {count} times in a row at {self._where_is(s)} without "
                f"delivering a chunk (a poison document there, or workers lost faster than they "
                f"restart); last error: {type(cause).__name__}: {cause}", stream_id=s) from cause

    def _skip_poison(self, s: int) -> bool:
        """Runs stream ``s``'s next chunk on a disposable worker that names each document
        before tokenizing it. If that worker dies, the document it named is the poison: it is
        added to the stream's resume state (skipped and counted as ``worker_crash``). Returns
        False when the worker died without naming a document (the failures cannot be
        located); True otherwise, and the failure count starts over."""
        mailbox = Mailbox.remote()
        probe = self._spawn()
        state, skip = self._resume[s]
        log.warning("stream %d failed %d times at %s: locating the document that kills its "
                    "workers (on_bad_document: skip)", s, self.max_failures, self._where_is(s))
        try:
            _raise_worker_error(_get(probe.open.remote(s, state, skip), self._timeout,
                                     f"opening stream {s} to locate a poison document"))
            _get(probe.produce_traced.remote(s, self._config.chunk_rows, mailbox),
                 self._timeout, f"a traced chunk of stream {s}")
        except _WORKER_LOST:
            raw = _get(mailbox.get.remote(), self._timeout, "the place a worker died at")
            if raw is None:
                return False
            where = json.loads(raw)
            stream = open_stream(self._config, self._plan, s)
            if state is not None:
                stream.set_state(state)
            stream.add_poison(where)
            self._resume[s] = (stream.get_state(), skip)
            self._failures.pop(s, None)
            self.poisoned += 1
            log.warning("stream %d: skipping the document at %s that killed %d workers "
                        "(counted as worker_crash)", s, where, self.max_failures + 1)
            return True
        finally:
            ray.kill(mailbox, no_restart=True)
            self._names.pop(id(probe), None)
            ray.kill(probe, no_restart=True)
        # The chunk came back: the failures were not this stream's data. Go on retrying.
        self._failures.pop(s, None)
        return True

    def _where_is(self, s: int) -> str:
        """The file and row at stream ``s``'s resume position, for error messages."""
        state, skip = self._resume[s]
        stream = open_stream(self._config, self._plan, s)
        if state is not None:
            stream.set_state(state)
        where = stream.describe_head()
        return where + (f", {skip} rows further" if skip else "")

    def close(self) -> None:
        for w in self._workers + self._pending:
            ray.kill(w, no_restart=True)
        self._workers, self._pending = [], []


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
