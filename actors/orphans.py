"""Streams whose worker is gone and whose replacement has no CPU: where they go meanwhile.

When a whole node is lost, its CPUs go with it: a replacement worker may wait for a CPU until
a node joins or comes back. The streams of the lost worker must not wait with it while another
worker runs, so they are reopened on the workers still running (the least loaded first), and
the replacement takes its share once it starts. Only when no worker runs at all does the pool
wait, for the first replacement to start: without a deadline (an autoscaler may take minutes
to add a node), with a warning every ``get_timeout_s`` that names the streams waiting and says
what would end it. A replacement that dies before it starts (placed on a node being lost) is
replaced in turn.

Example: 2 workers on 3 one-CPU nodes; the 2 nodes holding them are lost::

    worker a (node 1, streams 0-3) lost -> replacement a' starts on node 3
    worker b (node 2, streams 4-7) lost -> replacement b' waits for a CPU;
                                           streams 4-7 move to a' (a' holds 0-7)
    a node joins                        -> b' starts and takes streams 4-7 back
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

__all__ = ["REPLACEMENT_START_S", "OrphanedStreams", "sort_started", "spread", "started"]

log = logging.getLogger("ingest.pool")

# How long a replacement may take to start before its streams go to the workers still running.
# Two workers start in 0.3 s on an idle machine (actors.worker), a few seconds on a busy one;
# one not started after 30 times that waits for a CPU (a lost node took it).
REPLACEMENT_START_S = 10.0


def started(where: ray.ObjectRef, timeout_s: float) -> bool:
    """Whether the worker whose ``where()`` call is ``where`` starts within ``timeout_s`` (a
    worker that died starting counts as started: its next call fails and replaces it)."""
    ready, _ = ray.wait([where], num_returns=1, timeout=timeout_s)
    return bool(ready)


def sort_started(wheres: list[ray.ObjectRef], timeout_s: float) -> tuple[list[int], list[int]]:
    """Waits up to ``timeout_s`` until a pending worker starts or dies (none: returns at once).

    Args:
      wheres: the pending workers' ``where()`` refs.
      timeout_s: the longest wait for the first to start or die.

    Returns:
      The indices into ``wheres`` of the workers started, and of those that died before they
      started (placed on a node that was lost, say).
    """
    if timeout_s > 0:
        ray.wait(wheres, num_returns=1, timeout=timeout_s)
    ready, _ = ray.wait(wheres, num_returns=len(wheres), timeout=0)
    ready = set(ready)
    up, died = [], []
    for i, where in enumerate(wheres):
        if where not in ready:
            continue
        try:
            ray.get(where, timeout=0)
            up.append(i)
        except ray.exceptions.RayError:
            died.append(i)
    return up, died


def spread(streams: list[int], load: dict[Any, list[int]]) -> list[tuple[int, Any]]:
    """``(stream, worker key)`` for each of ``streams``, each onto the worker of ``load``
    (worker key -> its streams) that holds the fewest at that point; updates ``load``."""
    moves = []
    for t in streams:
        idlest = min(load, key=lambda k: len(load[k]))
        load[idlest].append(t)
        moves.append((t, idlest))
    return moves


class OrphanedStreams:
    """The lost-node side of ``actors.pool.WorkerPool`` (mixed into it).

    Reads the pool's ``_timeout``, ``_where``, ``_names``, ``_spawn``, ``_move`` and
    ``_count_failure``; changes ``_workers``, ``_pending`` and ``_placement`` (through
    ``_move``); keeps the counts ``cpu_waits``, ``cpu_wait_s`` and ``restarts``.
    """

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
        moves = [(t, by_id[k]) for t, k in spread(moved, load)]
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
            up, died = sort_started([self._where[id(w)] for w in self._pending], self._timeout)
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
