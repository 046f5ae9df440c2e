"""Resizing the pool while it runs: on request (``HostFeed.resize``) or by the autoscale policy
(``actors.autoscale``).

A new worker takes streams only once it has started, so a worker still waiting for a CPU (a
node joining) never stalls a stream. Streams move by reopening them on their new worker from
the last chunk received, like a dead worker's (``actors.recovery``): the output never changes.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

from actors import orphans
from actors.autoscale import AutoscalePolicy
from actors.calls import WORKER_LOST, get_within, raise_worker_error

__all__ = ["PoolResizing"]

log = logging.getLogger("ingest.pool")


class PoolResizing:
    """The resize side of ``actors.pool.WorkerPool`` (mixed into it).

    Reads the pool's ``_stream_ids``, ``_timeout``, ``_where``, ``_resume``, ``_exhausted``,
    ``wait_s``, ``_spawn``, ``_fill``, ``_replace`` and ``_respawn``; changes ``_workers``,
    ``_pending`` (workers started but still waiting for a CPU), ``_placement`` and
    ``_queues``; keeps
    ``_target_workers``, ``_autoscale``, ``_scale_mark`` and the count ``resizes``.
    """

    def _start_autoscale(self, config) -> None:
        """Sets up the autoscale policy if ``config.autoscale`` asks for one."""
        self._target_workers: int | None = None
        self._autoscale: AutoscalePolicy | None = None
        if config.autoscale:
            self._autoscale = AutoscalePolicy(
                min_workers=min(config.min_workers, len(self._stream_ids)),
                max_workers=min(config.max_workers or len(self._stream_ids),
                                len(self._stream_ids)),
                window_s=config.autoscale_window_s)
            self._scale_mark = (time.perf_counter(), 0.0)
        self.resizes = 0

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
        by_id = {id(w): w for w in keep}
        moves = [(t, by_id[k]) for t, k in orphans.spread(
            [t for w in drop for t in load[id(w)]], {k: load[k] for k in by_id})]
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
                raise_worker_error(get_within(ref, self._timeout, f"reopening stream {t}"))
            except WORKER_LOST as e:
                self._replace(w, t, e)
        for t, _ in moves:
            if t not in self._exhausted:
                self._fill(t)
