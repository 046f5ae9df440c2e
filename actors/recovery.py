"""Recovery: replacing a dead worker and reopening its streams where the host last received
them.

When a worker dies (or a call on it fails unexpectedly), the pool replaces it and reopens each
of its streams from the ``state_after`` of the last chunk received for that stream; requests
still in flight are issued again. Streams are deterministic, so no row is lost or repeated.
A stream that keeps failing at the same position stops the run with an error naming it, or,
with ``on_bad_document: skip``, has the document that kills its workers located and skipped
(``actors.poison``).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from actors import orphans
from actors.calls import WORKER_LOST, get_within, raise_worker_error
from actors.in_flight import InFlightRequests
from actors.metrics import HostMetrics
from actors.placement import Placement
from actors.poison import PoisonLocator, describe_position
from ingest.config import Config
from ingest.errors import StreamError
from ingest.plan.build import UnitPlan
from ingest.stream.chunk import StartAt

__all__ = ["WorkerRecovery"]

log = logging.getLogger("ingest.pool")


class WorkerRecovery:
    """Where each stream reopens, and the replacing of lost workers.

    Args:
      config: the validated config.
      plan: the unit plan (for error messages naming a file and row).
      placement: the pool's workers; changed here as workers are replaced.
      requests: the requests in flight; those of moved streams are dropped and made again.
      poison: locates a document that kills workers (``on_bad_document: skip``).
      metrics: the host's metrics (restarts).
      timeout_s: how long reopening a stream may take; while no worker can run, how often a
        warning says so.

    Attributes:
      max_failures: failures of one stream in a row, at one place and without a chunk
        delivered between them, that stop the run (preemptions can come back to back, a
        poison document fails every time).
      restarts: workers replaced.
      cpu_waits: times every worker was lost and the streams waited for a CPU.
      cpu_wait_s: the seconds of those waits.
    """

    def __init__(self, config: Config, plan: UnitPlan, placement: Placement,
                 requests: InFlightRequests, poison: PoisonLocator, metrics: HostMetrics, *,
                 timeout_s: float):
        self._config = config
        self._plan = plan
        self._placement = placement
        self._requests = requests
        self._poison = poison
        self._metrics = metrics
        self._timeout = timeout_s
        # Where to reopen each stream if its worker dies: (state, rows to skip).
        self._resume: dict[int, StartAt] = {}
        self._failures: dict[int, tuple[str, int]] = {}  # stream -> (position, count)
        self.max_failures = 5
        self.restarts = 0
        self.cpu_waits = 0
        self.cpu_wait_s = 0.0

    def start_at(self, states: dict[int, StartAt]) -> None:
        """The streams of ``states`` (re)open there."""
        self._resume.update(states)

    def forget_failures(self) -> None:
        self._failures.clear()

    def received(self, s: int, state_after: dict[str, Any]) -> None:
        """Stream ``s`` delivered a chunk ending at ``state_after``: it reopens there, and its
        failures start over."""
        self._resume[s] = (state_after, 0)
        self._failures.pop(s, None)

    def replace(self, dead, s: int, cause: BaseException) -> None:
        """Replaces worker ``dead`` (which failed serving stream ``s``) and reopens its streams
        where the host last received them. A replacement that dies too is replaced again,
        within the same budget of failures without progress."""
        place = self._placement
        while True:
            self._count_failure(s, cause)
            log.warning("worker for stream %d failed (%s: %s); replacing it and reopening its "
                        "streams from the last chunk received", s, type(cause).__name__,
                        str(cause).splitlines()[0] if str(cause) else "")
            i = next((i for i, w in enumerate(place.workers) if w is dead), None)
            if i is None:
                return  # Already replaced while serving another of its streams.
            place.kill(dead)
            fresh = place.spawn()
            self._count_restart()
            moved = place.streams_on(dead)
            self._requests.drop(moved, alone=True)
            if not orphans.started(place.location(fresh), orphans.REPLACEMENT_START_S):
                # No CPU for it (a lost node took it): it waits as a pending worker.
                del place.workers[i]
                place.pending.append(fresh)
                self._rehome(moved)
                return
            place.workers[i] = fresh
            for t in moved:
                place.assign(t, fresh)
            refs = [fresh.open.remote(t, *self._resume[t]) for t in moved]
            try:
                outs = get_within(refs, self._timeout,
                                  f"reopening streams {moved} on a new worker")
            except WORKER_LOST as e:
                dead, cause = fresh, e
                continue
            for out in outs:
                raise_worker_error(out)
            self._requests.refill([t for t in moved if not self._requests.ended(t)])
            return

    def move(self, moves: list[tuple[int, Any]]) -> None:
        """Reopens streams on other (started) workers from the last chunk received."""
        for t, w in moves:
            self._placement.assign(t, w)
        self._requests.drop([t for t, _ in moves])
        refs = [w.open.remote(t, *self._resume[t]) for t, w in moves]
        for (t, w), ref in zip(moves, refs, strict=True):
            try:
                raise_worker_error(get_within(ref, self._timeout, f"reopening stream {t}"))
            except WORKER_LOST as e:
                self.replace(w, t, e)
        self._requests.refill([t for t, _ in moves if not self._requests.ended(t)])

    def sort_pending(self, timeout_s: float) -> list:
        """Files the pending workers that started (waiting up to ``timeout_s`` for one) as
        running, and starts another in place of each that died before it started; returns
        those that started."""
        place = self._placement
        if not place.pending:
            return []
        up, died = orphans.sort_started([place.location(w) for w in place.pending], timeout_s)
        started = [place.pending[i] for i in up]
        lost = [place.pending[i] for i in died]
        place.pending = [w for i, w in enumerate(place.pending) if i not in up + died]
        place.workers += started
        self._respawn(lost)
        return started

    def _respawn(self, lost: list) -> None:
        """Starts a pending worker in place of each of ``lost``, pending workers that died
        before they started (counted as restarts)."""
        place = self._placement
        for w in lost:
            log.warning("worker %s died before it started (its node lost?); starting another",
                        place.name_of(w))
            place.kill(w)
            place.pending.append(place.spawn())
            self._count_restart()

    def _count_restart(self) -> None:
        self.restarts += 1
        self._metrics.restarts.inc()

    def _rehome(self, moved: list[int]) -> None:
        """Reopens the streams ``moved`` of a lost worker on the workers still running, the
        least loaded first; when none runs, first waits for a pending one to start."""
        place = self._placement
        if not place.workers:
            self._wait_for_a_worker(moved)
        load = {id(w): [] for w in place.workers}
        for k, streams in place.load().items():
            if k in load:
                load[k] += [t for t in streams if t not in moved]
        by_id = {id(w): w for w in place.workers}
        moves = [(t, by_id[k]) for t, k in orphans.spread(moved, load)]
        log.warning("no CPU for a replacement worker yet: moving streams %s to the %d worker(s) "
                    "running; the replacement takes its share once it starts", moved,
                    len(place.workers))
        self.move(moves)

    def _wait_for_a_worker(self, streams: list[int]) -> None:
        """Waits, without a deadline, until a pending worker starts (a node joins or comes
        back), replacing those that die before they start; a warning every get_timeout_s,
        counted in ``cpu_waits`` and ``cpu_wait_s``."""
        place = self._placement
        t0 = time.perf_counter()
        self.cpu_waits += 1
        log.warning("no worker runs and no CPU is free for the %d replacement(s): streams %s "
                    "wait for one to start (a Ray node must join or come back; see `ray status`)",
                    len(place.pending), streams)
        while not place.workers:
            before = self.restarts
            self.sort_pending(self._timeout)
            for _ in range(self.restarts - before):
                self._count_failure(streams[0], RuntimeError("a worker died before it started"))
            if not place.workers and self.restarts == before:
                log.warning("still no CPU for a worker after %.0f s: streams %s wait (not an "
                            "error; the run goes on once a node joins or comes back; see `ray "
                            "status`)", time.perf_counter() - t0, streams)
        waited = time.perf_counter() - t0
        self.cpu_wait_s += waited
        log.warning("a worker started after %.0f s without a CPU: streams %s go on", waited,
                    streams)

    def _count_failure(self, s: int, cause: BaseException) -> None:
        """Counts failures of stream ``s`` at its current position; too many stop the run,
        unless ``on_bad_document: skip`` and the failures are a document that kills its
        worker, which is then located and skipped."""
        position = json.dumps(self._resume[s], sort_keys=True)
        last, count = self._failures.get(s, (None, 0))
        count = count + 1 if last == position else 1
        self._failures[s] = (position, count)
        if count >= self.max_failures and self._config.on_bad_document == "skip":
            at = self._poison.locate(s, self._resume[s], count)
            if at is not None:
                self._resume[s] = at
                self._failures.pop(s, None)
                return
        if count >= self.max_failures:
            where = describe_position(self._config, self._plan, s, self._resume[s])
            raise StreamError(
                f"stream {s} failed {count} times in a row at {where} without "
                f"delivering a chunk (a poison document there, or workers lost faster than they "
                f"restart); last error: {type(cause).__name__}: {cause}", stream_id=s) from cause
