"""The worker pool: places streams on workers and keeps a bounded FIFO of chunk requests per
stream.

The host holds the object refs, so it owns the chunks: a chunk already produced survives its
worker. Requests per stream are bounded by ``prefetch``, so object-store memory is bounded by
``streams x prefetch x chunk bytes``.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import ray

from actors.worker import WORKER_ENV, StreamWorker, WorkerError
from ingest.config import Config
from ingest.errors import StreamError
from ingest.plan import UnitPlan
from ingest.stream import Chunk

__all__ = ["WorkerPool"]


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
        self._timeout = get_timeout_s
        self._plan_ref = ray.put(plan)
        n = min(num_workers, len(self._stream_ids))
        self._workers = [
            StreamWorker.options(runtime_env={"env_vars": WORKER_ENV}).remote(
                config, self._plan_ref, f"w{i}") for i in range(n)]
        self._placement = {s: self._workers[i % n] for i, s in enumerate(self._stream_ids)}
        self._queues: dict[int, collections.deque] = {s: collections.deque()
                                                      for s in self._stream_ids}
        self._exhausted: set[int] = set()
        self.chunks_received = 0
        self.wait_s = 0.0

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def open(self, states: dict[int, tuple[dict[str, Any] | None, int]]) -> None:
        """Opens every stream at ``(state, rows to skip)`` (None state: the beginning)."""
        refs = [self._placement[s].open.remote(s, st, skip) for s, (st, skip) in states.items()]
        for out in _get(refs, self._timeout, "opening streams"):
            if isinstance(out, WorkerError):
                raise StreamError(str(out), stream_id=out.stream_id,
                                  worker=out.worker) from out.cause
        for s in self._stream_ids:
            self._fill(s)

    def _fill(self, s: int) -> None:
        q = self._queues[s]
        while len(q) < self._config.prefetch and s not in self._exhausted:
            q.append(self._placement[s].produce.remote(s, self._config.chunk_rows))

    def next_chunk(self, s: int) -> Chunk:
        """The stream's next chunk, in order; keeps ``prefetch`` requests in flight."""
        q = self._queues[s]
        if not q:
            self._fill(s)
        ref = q.popleft()
        t0 = time.perf_counter()
        out = _get(ref, self._timeout, f"a chunk of stream {s}")
        self.wait_s += time.perf_counter() - t0
        if isinstance(out, WorkerError):
            raise StreamError(str(out), stream_id=out.stream_id, worker=out.worker) from out.cause
        self.chunks_received += 1
        if out.exhausted:
            self._exhausted.add(s)
            # Requests already queued behind the last chunk return empty chunks; drop them.
            q.clear()
        else:
            self._fill(s)
        return out

    def close(self) -> None:
        for w in self._workers:
            ray.kill(w, no_restart=True)
        self._workers = []


def _get(refs, timeout: float, what: str):
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError as e:
        raise TimeoutError(f"waited {timeout:.0f} s for {what} from the Ray workers; check the "
                           f"cluster (`ray status`) and the worker logs") from e
