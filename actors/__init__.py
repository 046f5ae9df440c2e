"""actors: the Ray side: the worker actor and the pool that places streams on workers."""

from actors.pool import WorkerPool
from actors.worker import WORKER_ENV, StreamWorker

__all__ = ["WORKER_ENV", "StreamWorker", "WorkerPool"]
