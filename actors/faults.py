"""Fault injection for tests, demos and ``ingest run --kill-worker-every``.

Every way of breaking a running feed on purpose lives here, outside the product classes:

- ``inject_poison(pool, marker)``: every worker of a pool, present and future, dies (like a
  segfault in a tokenizer) when it tokenizes a document containing ``marker``;
- ``inject_error(pool, stream_id, at_row)``: a stream's worker fails once, partway through the
  chunk that would emit row ``at_row``;
- ``kill_random_worker(pool, rng)`` and ``WorkerKiller`` (``--kill-worker-every``): SIGKILL a
  random worker's process, once or on a timer.

A worker keeps what was injected into it in a ``WorkerFaults``
(``StreamWorker.set_faults``); the pool hands its ``worker_faults`` to each worker it starts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from typing import Any

import numpy as np
import ray

__all__ = ["PoisonedTokenizer", "WorkerFaults", "WorkerKiller", "inject_error", "inject_poison",
           "kill_random_worker"]

log = logging.getLogger("ingest")

# How long kill_random_worker waits for a worker to say where it runs.
WHERE_TIMEOUT_S = 30


@dataclasses.dataclass
class WorkerFaults:
    """The faults injected into one worker.

    Attributes:
      poison_marker: the worker's process dies on a document containing it.
      error_at: ``(stream_id, row)``: that stream's produce call that would emit ``row`` fails
        partway through its chunk, once.
    """

    poison_marker: str | None = None
    error_at: tuple[int, int] | None = None

    def __bool__(self) -> bool:
        return self.poison_marker is not None or self.error_at is not None

    def update(self, other: WorkerFaults) -> None:
        """Takes the faults ``other`` sets; keeps the others."""
        if other.poison_marker is not None:
            self.poison_marker = other.poison_marker
        if other.error_at is not None:
            self.error_at = other.error_at

    def tokenizer(self, tokenizer):
        """``tokenizer``, or one that kills the process on a poisoned document."""
        if self.poison_marker is None:
            return tokenizer
        return PoisonedTokenizer(tokenizer, self.poison_marker)

    def before_produce(self, stream, stream_id: int, n_rows: int, worker: str) -> None:
        """Raises the injected error if this produce call of ``stream`` would emit its row,
        after producing the rows before it (so the failure lands mid-chunk).

        Raises:
          RuntimeError: the injected error, once.
        """
        if self.error_at is None or self.error_at[0] != stream_id:
            return
        done = stream.get_state()["rows_emitted"]
        at = self.error_at[1]
        if done < at <= done + n_rows:
            self.error_at = None
            if at - done > 1:
                stream.produce(at - done - 1)
            raise RuntimeError(f"injected error in worker {worker}, stream {stream_id}, "
                               f"at row {at}")


class PoisonedTokenizer:
    """A tokenizer that kills its process on a marked document (``inject_poison``)."""

    def __init__(self, tokenizer, marker: str):
        self._tok = tokenizer
        self._marker = marker
        self.name, self.eos_id, self.vocab_size = (tokenizer.name, tokenizer.eos_id,
                                                   tokenizer.vocab_size)

    def encode_batch(self, texts: list[str]):
        self._check(texts)
        return self._tok.encode_batch(texts)

    def encode_docs(self, texts: list[str]):
        self._check(texts)
        return self._tok.encode_docs(texts)

    def _check(self, texts: list[str]) -> None:
        if any(self._marker in t for t in texts):
            os._exit(70)  # no cleanup, no exception: what a crashing native library does


def inject_poison(pool, marker: str) -> None:
    """Every worker of ``pool`` (an ``actors.pool.WorkerPool``), present and future, dies when
    it tokenizes a document containing ``marker``."""
    pool.worker_faults.poison_marker = marker
    for w in pool.workers + pool.pending_workers:
        w.set_faults.remote(WorkerFaults(poison_marker=marker))


def inject_error(pool, stream_id: int, at_row: int) -> None:
    """Stream ``stream_id``'s worker in ``pool`` fails partway through the chunk that would
    emit row ``at_row`` (once). Pick a row past the requests already in flight."""
    pool.worker_of(stream_id).set_faults.remote(WorkerFaults(error_at=(stream_id, at_row)))


def kill_random_worker(pool, rng: np.random.Generator) -> str | None:
    """SIGKILLs a random worker's process of ``pool`` (``ray.kill`` when it runs on another
    node); the pool notices the death like any other. Safe from any thread.

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


class WorkerKiller:
    """``--kill-worker-every``: SIGKILLs a random worker of a feed's pool every ``every_s``
    seconds, on a thread of its own, until ``stop``."""

    def __init__(self, feed: Any, every_s: float, seed: int = 0):
        self.killed = 0
        self._feed = feed
        self._every = every_s
        self._rng = np.random.default_rng(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="WorkerKiller", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._every):
            # The feed's Ray pool once it runs (None before; the local backend has none).
            pool = self._feed._intake.source
            if pool is None or not hasattr(pool, "worker_faults"):
                continue
            what = kill_random_worker(pool, self._rng)
            if what:
                self.killed += 1
                log.warning("fault injection: killed worker %s", what)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
