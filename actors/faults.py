"""Killing workers on purpose, from outside (tests, demos, ``ingest-dev run --kill-worker-every``).

Nothing here reaches inside a worker: a worker is SIGKILLed like the kernel's OOM killer would,
and the pool notices the death as it notices any other.

- ``kill_random_worker(pool, rng)``: a random worker of one pool, once.
- ``WorkerKiller(every_s)``: a random worker of this process's own Ray cluster, on a timer.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import numpy as np
import psutil
import ray

__all__ = ["WorkerKiller", "kill_random_worker"]

log = logging.getLogger("ingest")

# How long kill_random_worker waits for a worker to say where it runs.
WHERE_TIMEOUT_S = 30

# Ticks without a worker to kill before the killer says that it finds none.
EMPTY_TICKS_WARNING = 5

# The title Ray gives a worker actor's process: ``ray::`` and the class name, then the method
# it runs, if any.
WORKER_TITLE = "ray::StreamWorker"


def kill_random_worker(pool, rng: np.random.Generator) -> str | None:
    """SIGKILLs a random worker's process of ``pool`` (an ``actors.pool.WorkerPool``;
    ``ray.kill`` when it runs on another node). Safe from any thread.

    Returns:
      ``"pid N"`` of the worker killed, or None when there was none to kill.
    """
    workers = pool.workers
    if not workers:
        return None
    w = workers[int(rng.integers(len(workers)))]
    try:
        pid, node = ray.get(pool.location(w), timeout=WHERE_TIMEOUT_S)
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


def worker_processes() -> list[psutil.Process]:
    """The worker actor processes of the Ray cluster this process started (its descendants:
    a local cluster's raylet forks them). Empty for a cluster started elsewhere."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmdline = p.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if cmdline and cmdline[0].startswith(WORKER_TITLE):
            found.append(p)
    return found


class WorkerKiller:
    """``--kill-worker-every``: SIGKILLs a random worker process of this process's own Ray
    cluster every ``every_s`` seconds, on a thread of its own, until ``stop``.

    Attributes:
      killed: workers killed so far.
    """

    def __init__(self, every_s: float, seed: int = 0):
        if not every_s > 0:
            raise ValueError(f"every_s={every_s!r}: give a positive number of seconds")
        self.killed = 0
        self._every = every_s
        self._rng = np.random.default_rng(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="WorkerKiller", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        empty = 0
        while not self._stop.wait(self._every):
            workers = worker_processes()
            if not workers:
                # None running yet (Ray starting), or a cluster this process did not start.
                empty += 1
                if empty == EMPTY_TICKS_WARNING and not self.killed:
                    log.warning("fault injection: no worker process of a Ray cluster this "
                                "process started found after %d tries; a cluster joined with "
                                "--address runs its workers elsewhere, and none is killed",
                                empty)
                continue
            p = workers[int(self._rng.integers(len(workers)))]
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                continue
            self.killed += 1
            log.warning("fault injection: killed worker pid %d", p.pid)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
