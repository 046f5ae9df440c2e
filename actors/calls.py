"""Waiting on worker calls: the failures that mean a worker is lost, and the error a worker
sends back as a value, raised on the host."""

from __future__ import annotations

import ray

from actors.worker import WorkerError
from ingest.errors import StreamError

__all__ = ["WORKER_LOST", "get_within", "raise_worker_error"]

# A lost worker, node or object, or an unexpected failure inside a call: all are retried by
# reopening the stream on a new worker. Bad input travels as a WorkerError value, not these.
WORKER_LOST = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
               ray.exceptions.ObjectLostError, ray.exceptions.NodeDiedError,
               ray.exceptions.RayTaskError)


def raise_worker_error(out) -> None:
    """Raises a worker's error (a ``WorkerError`` value) on the host as a ``StreamError``."""
    if isinstance(out, WorkerError):
        raise StreamError(str(out), stream_id=out.stream_id, worker=out.worker) from out.cause


def get_within(refs, timeout: float, what: str):
    """``ray.get(refs)``, failing after ``timeout`` seconds with an error naming ``what``."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError as e:
        raise TimeoutError(f"waited {timeout:.0f} s for {what} from the Ray workers; check the "
                           f"cluster (`ray status`) and the worker logs") from e
