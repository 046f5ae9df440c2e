"""The worker actor: hosts some streams and produces their chunks on request.

Thin by design: it wraps `ingest.Stream` objects and forwards calls. One worker is one CPU:
tokenizers run single-threaded and the process never touches an accelerator.
"""

from __future__ import annotations

import os
from typing import Any

import ray

from ingest.config import Config
from ingest.errors import BadInputError, StreamError
from ingest.plan import UnitPlan
from ingest.stream import Chunk, Stream

__all__ = ["WORKER_ENV", "StreamWorker"]

# JAX_PLATFORMS: workers must never grab an accelerator (DESIGN.md). The thread caps keep
# tokenizers and numpy to the one CPU the actor reserves. Set in the actor's own process at
# start, before anything reads them: the same effect as a runtime_env, without the fresh worker
# processes a runtime_env forces (0.9 s against 0.3 s to start two actors, measured here).
WORKER_ENV = {
    "JAX_PLATFORMS": "cpu",
    "TOKENIZERS_PARALLELISM": "false",
    "RAYON_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
}


class WorkerError(RuntimeError):
    """An error raised inside a worker, travelling as a value with its worker and stream."""

    def __init__(self, message: str, *, stream_id: int, worker: str, cause: BaseException):
        super().__init__(message)
        self.stream_id = stream_id
        self.worker = worker
        self.cause = cause

    def __reduce__(self):
        return (_rebuild_worker_error, (str(self), self.stream_id, self.worker, self.cause))


def _rebuild_worker_error(message, stream_id, worker, cause):
    return WorkerError(message, stream_id=stream_id, worker=worker, cause=cause)


@ray.remote(num_cpus=1, max_restarts=0, max_task_retries=0)
class StreamWorker:
    """Produces chunks for the streams opened on it."""

    def __init__(self, config: Config, plan: UnitPlan, name: str):
        os.environ.update(WORKER_ENV)
        self._config = config
        self._plan = plan
        self._name = name
        self._streams: dict[int, Stream] = {}

    def pid(self) -> int:
        return os.getpid()

    def where(self) -> tuple[int, str]:
        """(process id, Ray node id): lets the host kill this process for fault injection."""
        return os.getpid(), ray.get_runtime_context().get_node_id()

    def open(self, stream_id: int, state: dict[str, Any] | None,
             skip_rows: int = 0) -> int | WorkerError:
        """Opens (or reopens) a stream at ``state``, then drops ``skip_rows`` rows."""
        s = Stream(self._config, self._plan, stream_id)
        if state is not None:
            out = self._call(stream_id, s.set_state, state)
            if isinstance(out, WorkerError):
                return out
        self._streams[stream_id] = s
        if skip_rows:
            out = self._call(stream_id, s.produce, skip_rows)
            if isinstance(out, WorkerError):
                return out
        return stream_id

    def close(self, stream_id: int) -> dict[str, Any] | None:
        s = self._streams.pop(stream_id, None)
        return None if s is None else s.get_state()

    def produce(self, stream_id: int, n_rows: int) -> Chunk | WorkerError:
        s = self._streams.get(stream_id)
        if s is None:
            return WorkerError(f"stream {stream_id} is not open on worker {self._name}; this is "
                               f"a bug in actors.pool", stream_id=stream_id, worker=self._name,
                               cause=KeyError(stream_id))
        return self._call(stream_id, s.produce, n_rows)

    def _call(self, stream_id: int, fn, *args):
        try:
            return fn(*args)
        except (BadInputError, StreamError, ValueError, OSError) as e:
            # Errors travel as values so the host re-raises them with worker and stream named.
            return WorkerError(f"worker {self._name}, stream {stream_id}: {e}",
                               stream_id=stream_id, worker=self._name, cause=e)
