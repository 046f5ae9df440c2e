"""Placement: how many workers a pool starts, and which worker runs which streams.

Streams are cut into groups of ``streams_per_call`` consecutive ids (one actor call makes the
next chunk of every stream of a group: fewer calls and objects), and the groups are dealt to
the running workers in turn::

    streams 0..7 on 2 workers, streams_per_call 4:   w0 <- (0 1 2 3)         w1 <- (4 5 6 7)
    streams 0..7 on 3 workers, streams_per_call 2:   w0 <- (0 1) (6 7)  w1 <- (2 3)  w2 <- (4 5)

``streams_per_call`` is at most a worker's share of the streams, so that every worker gets a
group (``ingest.runtime.streams_per_call_for``). After a resize or a replacement a group's
streams may sit on different workers; each worker's part is then asked for on its own.

``Placement`` holds a pool's workers (running, and pending: started but waiting for a CPU)
and each stream's worker; the other parts of the pool change them through its methods.
"""

from __future__ import annotations

import collections
import logging
import os
from typing import Any

import ray

from actors.worker import HOST_ENV, StreamWorker, actor_class
from ingest.config import Config
from ingest.runtime import ResolvedRuntime

__all__ = ["Placement", "group_streams", "idle_workers", "place_groups", "pool_size",
           "uneven_share"]

log = logging.getLogger("ingest.pool")


class Placement:
    """A pool's workers and which of them runs each stream.

    Args:
      config: the validated config.
      plan_ref: the unit plan, in the object store.
      stream_ids: the streams of the pool.
      runtime: the config's runtime options resolved (``streams_per_call``).
      worker_cls: ``StreamWorker`` or a subclass of it.
      prefault_bytes: the object store each worker maps as it starts.
      timeout_s: how long the first workers may take to start.

    Attributes:
      workers: the worker actors running, in the order started.
      pending: the worker actors started but waiting for a CPU.
      streams_per_call: the streams one call makes chunks of (``group_of``).
    """

    def __init__(self, config: Config, plan_ref: ray.ObjectRef, stream_ids: list[int], *,
                 runtime: ResolvedRuntime, worker_cls: type[StreamWorker], prefault_bytes: int,
                 timeout_s: float):
        self._config = config
        self._runtime = runtime
        self._plan_ref = plan_ref
        self._stream_ids = list(stream_ids)
        self._actor_cls = actor_class(worker_cls)
        self._prefault_bytes = prefault_bytes
        self._timeout = timeout_s
        self.workers: list = []
        self.pending: list = []
        self.streams_per_call = 1
        self._where: dict[int, ray.ObjectRef] = {}
        self._names: dict[int, str] = {}
        self._next_name = 0
        self._of: dict[int, Any] = {}
        self._group: dict[int, tuple[int, ...]] = {}

    def spawn(self):
        """A new worker actor (neither running nor pending until the caller files it)."""
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

    def start(self, n: int) -> None:
        """Starts ``n`` workers, those the cluster has no CPU for yet as pending, and places
        the streams on those running."""
        # Workers beyond the cluster's CPUs start as pending, like a resize's (a node may
        # join; they take streams once they run): the streams open on the workers that can
        # run instead of waiting for all of them. The cluster's total, not its free CPUs:
        # those lag behind actors that were just killed.
        start_now = min(n, max(1, int(ray.cluster_resources().get("CPU", 0))))
        if start_now < n:
            log.warning("workers=%d, but the Ray cluster has %d CPU(s) and each worker takes "
                        "one: starting with %d, the other %d wait for a CPU (a node joining); "
                        "lower workers, or add CPUs (`ray start --num-cpus`, more nodes)",
                        n, start_now, start_now, n - start_now)
        self.workers = [self.spawn() for _ in range(n)]
        if start_now < n:
            # Ray starts actors in no set order: the first to start take the streams.
            refs = [self._where[id(w)] for w in self.workers]
            ready, _ = ray.wait(refs, num_returns=start_now, timeout=self._timeout)
            if not ready:
                for w in self.workers:
                    self.kill(w)
                raise TimeoutError(f"none of {n} workers started within {self._timeout:.0f} s: "
                                   f"check the cluster (`ray status`) and the worker logs")
            self.pending = [w for w in self.workers if self._where[id(w)] not in ready]
            self.workers = [w for w in self.workers if self._where[id(w)] in ready]
        self._place(n)

    def _place(self, n: int) -> None:
        """Groups the streams for a pool of ``n`` workers and places the groups on the
        workers running."""
        runtime = self._runtime
        g = runtime.streams_per_call_on(len(self._stream_ids), n)
        self.streams_per_call = g
        if g != runtime.streams_per_call:
            log.info("streams_per_call=%d: this host's %d streams on %d workers (the config's "
                     "%d counts num_streams=%d on workers=%d)", g, len(self._stream_ids), n,
                     runtime.streams_per_call, runtime.num_streams, runtime.options.workers)
        self._group = group_streams(self._stream_ids, g)
        self._of = place_groups(self._stream_ids, g, self.workers)
        uneven = uneven_share(self._of, len(self.workers))
        if uneven:
            pace, why = uneven
            # A tenth of the workers' rate or more lost is worth a warning.
            log.log(logging.WARNING if pace < 0.9 * len(self.workers) else logging.INFO,
                    "%s", why)

    def worker_of(self, s: int):
        """The worker actor stream ``s`` is placed on."""
        return self._of[s]

    def assign(self, s: int, w) -> None:
        """Places stream ``s`` on worker ``w``."""
        self._of[s] = w

    def group_of(self, s: int) -> tuple[int, ...]:
        """The streams one call may make chunks of with ``s`` (on one worker)."""
        return self._group[s]

    def streams_on(self, w) -> list[int]:
        """The streams placed on worker ``w``."""
        return [t for t, x in self._of.items() if x is w]

    def load(self) -> dict[int, list[int]]:
        """``id(worker)`` -> its streams, for every worker running."""
        load: dict[int, list[int]] = {id(w): [] for w in self.workers}
        for t, w in self._of.items():
            load.setdefault(id(w), []).append(t)
        return load

    def location(self, w) -> ray.ObjectRef:
        """``(process id, Ray node id)`` of worker ``w`` (a ref, asked when it started)."""
        return self._where[id(w)]

    def name_of(self, w) -> str:
        return self._names.get(id(w), "?")

    def kill(self, w) -> None:
        """Ends worker ``w`` (one lost already included)."""
        try:
            ray.kill(w, no_restart=True)
        except Exception:  # noqa: BLE001 -- a worker lost already is gone either way
            pass

    def close(self) -> None:
        for w in self.workers + self.pending:
            self.kill(w)
        self.workers, self.pending = [], []


def pool_size(config: Config, num_workers: int, streams: int) -> int:
    """Workers a pool of ``streams`` streams starts with: ``num_workers``, at most one per
    stream (one more would have nothing to do), within the autoscale bounds when
    ``config.runtime.autoscale``."""
    n = min(num_workers, streams)
    opts = config.runtime
    if opts.autoscale:
        n = max(opts.min_workers, min(opts.max_workers or n, n))
        n = min(n, streams)
    return n


def idle_workers(num_workers: int, streams: int, num_streams: int) -> str | None:
    """Why fewer than ``num_workers`` workers start for a host's ``streams`` streams (of
    ``num_streams`` in all), or None where all of them start."""
    if num_workers <= streams:
        return None
    which = "streams" if streams == num_streams else f"streams (this host's, of {num_streams})"
    return (f"workers={num_workers} on {streams} {which}: {streams} workers start, one per "
            f"stream, as a stream is made by one worker at a time. For all {num_workers} to "
            f"work, use a num_streams that is a multiple of {num_workers} (that changes the "
            f"batches)")


def group_streams(stream_ids: list[int], per_call: int) -> dict[int, tuple[int, ...]]:
    """Each stream's group: ``per_call`` consecutive streams (the last group may be short)."""
    g = per_call
    return {s: tuple(stream_ids[i - i % g:i - i % g + g]) for i, s in enumerate(stream_ids)}


def place_groups(stream_ids: list[int], per_call: int, workers: list[Any]) -> dict[int, Any]:
    """Each stream's worker: the groups of ``group_streams`` dealt to ``workers`` in turn."""
    return {s: workers[(i // per_call) % len(workers)] for i, s in enumerate(stream_ids)}


def uneven_share(placement: dict[int, Any], workers: int) -> tuple[float, str] | None:
    """Where ``workers`` workers holding the streams of ``placement`` (stream -> worker) hold
    unequal shares: what they make, in evenly loaded workers, and a line saying why and what to
    change; None where every worker holds as many streams.

    Every batch takes rows of every stream, so a pool goes at the pace of its busiest worker:
    16 streams on 15 workers (one holds two) make what 8 workers make.
    """
    counts = collections.Counter(id(w) for w in placement.values())
    streams = len(placement)
    busiest = max(counts.values(), default=0)
    lightest = min(counts.values()) if len(counts) >= workers else 0
    if busiest == lightest:
        return None
    even = [d for d in range(1, streams + 1) if streams % d == 0]
    fewer = max(d for d in even if d <= workers)
    more = min((d for d in even if d > workers), default=None)
    choice = f"{fewer} or {more} workers" if more else f"{fewer} workers"
    pace = streams / busiest
    return pace, (f"{streams} streams on {workers} workers: the busiest worker holds "
                  f"{busiest} streams and the lightest {lightest}; every batch takes rows of "
                  f"every stream, so the pool makes what {pace:.1f} evenly loaded workers "
                  f"make. For an even share use {choice} (num_streams divides by them), or a "
                  f"num_streams that {workers} divides (that changes the batches)")
