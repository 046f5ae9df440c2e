"""Resizing the pool while it runs: on request (``HostFeed.resize``) or by the autoscale policy
(``actors.autoscale``).

A new worker takes streams only once it has started, so a worker still waiting for a CPU (a
node joining) never stalls a stream. Streams move by reopening them on their new worker from
the last chunk received, like a dead worker's (``actors.recovery``): the output never changes.
"""

from __future__ import annotations

import logging
import time

import ray

from actors import orphans
from actors.autoscale import AutoscalePolicy
from actors.in_flight import InFlightRequests
from actors.placement import Placement
from actors.recovery import WorkerRecovery
from ingest.config import Config

__all__ = ["PoolResizing"]

log = logging.getLogger("ingest.pool")


class PoolResizing:
    """The worker count of a pool: asked for (``request``) or decided by the autoscale policy,
    applied on the thread that takes chunks (``before_chunk``).

    Args:
      config: the validated config (``autoscale`` and its bounds).
      placement: the pool's workers; changed here.
      recovery: reopens moved streams where the host last received them.
      requests: the requests in flight (how many are ready, for the autoscale policy).
      streams: the pool's stream count (at most one worker each).

    Attributes:
      resizes: changes of the worker count applied.
    """

    def __init__(self, config: Config, placement: Placement, recovery: WorkerRecovery,
                 requests: InFlightRequests, streams: int):
        self._placement = placement
        self._recovery = recovery
        self._requests = requests
        self._streams = streams
        self._target: int | None = None
        self._autoscale: AutoscalePolicy | None = None
        opts = config.runtime
        if opts.autoscale:
            self._autoscale = AutoscalePolicy(
                min_workers=min(opts.min_workers, streams),
                max_workers=min(opts.max_workers or streams, streams),
                window_s=opts.autoscale_window_s)
        # (start of the autoscale window, the caller's wait in seconds then)
        self._scale_mark = (time.perf_counter(), 0.0)
        self.resizes = 0

    def request(self, n: int) -> None:
        """Asks for ``n`` workers; applied by the thread that calls ``before_chunk``, at its
        next call, so it is safe to call from any thread."""
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"resize to {n!r} workers: give a positive integer")
        self._target = n

    def before_chunk(self, wait_s: float) -> None:
        """Before a chunk is taken: the autoscale policy once per window (``wait_s``: the
        seconds the caller has waited for chunks in all), a resize asked for, and streams
        moved onto pending workers that have started."""
        if self._autoscale is not None:
            self._autoscale_step(wait_s)
        if self._target is not None:
            self._apply()
        self._adopt_ready()

    def _autoscale_step(self, wait_s: float) -> None:
        now = time.perf_counter()
        since, waited_before = self._scale_mark
        if now - since < self._autoscale.window_s:
            return
        self._scale_mark = (now, wait_s)
        queued = self._requests.refs()
        ready = len(ray.wait(queued, num_returns=len(queued), timeout=0)[0]) if queued else 0
        place = self._placement
        current = len(place.workers) + len(place.pending)
        target = self._autoscale.decide(
            workers=current, wait_fraction=(wait_s - waited_before) / (now - since),
            ready_fraction=ready / len(queued) if queued else 1.0)
        if target != current:
            log.info("autoscale: %d -> %d workers", current, target)
            self._target = target

    def _apply(self) -> None:
        place = self._placement
        n = min(self._target, self._streams)
        self._target = None
        have = len(place.workers) + len(place.pending)
        if n == have:
            return
        self.resizes += 1
        if n > have:
            # New workers take streams only once they have started: a worker still waiting for
            # a CPU (Ray's autoscaler adding a node, say) must never stall a stream.
            place.pending += [place.spawn() for _ in range(n - have)]
            log.info("growing the pool to %d workers (%d starting)", n, len(place.pending))
            return
        while place.pending and len(place.workers) + len(place.pending) > n:
            place.kill(place.pending.pop())
        if len(place.workers) <= n:
            return
        keep, drop = place.workers[:n], place.workers[n:]
        load = place.load()
        by_id = {id(w): w for w in keep}
        moves = [(t, by_id[k]) for t, k in orphans.spread(
            [t for w in drop for t in load[id(w)]], {k: load[k] for k in by_id})]
        place.workers = keep
        log.info("shrinking the pool to %d workers: moving streams %s", n, [t for t, _ in moves])
        self._recovery.move(moves)
        for w in drop:
            place.kill(w)

    def _adopt_ready(self) -> None:
        """Moves streams onto pending workers that have started, evening out the load."""
        started = self._recovery.sort_pending(0)
        if not started:
            return
        place = self._placement
        load = place.load()
        moves = []
        while True:
            busiest = max(place.workers, key=lambda w: len(load[id(w)]))
            idlest = min(place.workers, key=lambda w: len(load[id(w)]))
            if len(load[id(busiest)]) - len(load[id(idlest)]) <= 1:
                break
            t = load[id(busiest)].pop()
            load[id(idlest)].append(t)
            moves.append((t, idlest))
        log.info("%d new worker(s) started: moving streams %s", len(started),
                 [t for t, _ in moves])
        self._recovery.move(moves)
