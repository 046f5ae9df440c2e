"""The worker actor: hosts some streams and produces their chunks on request.

Thin by design: it wraps `ingest.Stream` objects and forwards calls. One worker is one CPU:
tokenizers run single-threaded and the process never touches an accelerator.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from typing import Any

import ray

from actors.metrics import WorkerMetrics
from ingest.config import Config
from ingest.errors import BadInputError, StreamError
from ingest.plan.build import UnitPlan
from ingest.stream.kinds import Chunk, Stream, open_stream
from ingest.stream.process import claim_cpu, one_cpu_producer, prefault_shared
from ingest.tokenize.tokenizer import load_tokenizer

__all__ = ["HOST_ENV", "WORKER_ENV", "StreamWorker", "actor_class"]

# JAX_PLATFORMS: workers must never grab an accelerator. The thread caps keep
# tokenizers and numpy to the one CPU the actor reserves. Set in the actor's own process at
# start, before anything reads them: the same effect as a runtime_env, without the fresh worker
# processes a runtime_env forces (which start several times slower).
WORKER_ENV = {
    "JAX_PLATFORMS": "cpu",
    "TOKENIZERS_PARALLELISM": "false",
    "RAYON_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
}

# The host's settings that its workers follow, wherever they run: the pool passes those set in
# the host's environment (a worker on another node does not inherit it).
HOST_ENV = ("INGEST_CACHE_DIR", "INGEST_ROW_GROUP_CACHE_GB")

# How long a traced worker waits for its mailbox to take a document's place.
TRACE_TIMEOUT_S = 60


class WorkerError(RuntimeError):
    """An error raised inside a worker, travelling as a value with its worker and stream.

    ``retryable`` is False for bad input (deterministic: it fails again at the same place) and
    True for everything else, which the pool retries on a fresh worker.
    """

    def __init__(self, message: str, *, stream_id: int, worker: str, cause: BaseException,
                 retryable: bool = False):
        super().__init__(message)
        self.stream_id = stream_id
        self.worker = worker
        self.cause = cause
        self.retryable = retryable

    def __reduce__(self):
        return (_rebuild_worker_error,
                (str(self), self.stream_id, self.worker, self.cause, self.retryable))


def _rebuild_worker_error(message, stream_id, worker, cause, retryable=False):
    return WorkerError(message, stream_id=stream_id, worker=worker, cause=cause,
                       retryable=retryable)


# Ray's options for every worker actor: one CPU, and no restart by Ray (the pool replaces a
# dead worker itself, reopening its streams where the host last received them).
WORKER_OPTIONS = {"num_cpus": 1, "max_restarts": 0, "max_task_retries": 0}


@functools.cache
def actor_class(cls: type[StreamWorker]):
    """The Ray actor class of ``cls`` (``StreamWorker`` or a subclass of it), made once."""
    return ray.remote(**WORKER_OPTIONS)(cls)


class StreamWorker:
    """Produces chunks for the streams opened on it; runs as a Ray actor (``actor_class``)."""

    def __init__(self, config: Config, plan: UnitPlan, name: str, *, prefault_bytes: int = 0,
                 host_env: dict[str, str] | None = None):
        os.environ.update(WORKER_ENV)
        os.environ.update({k: v for k, v in (host_env or {}).items() if k in HOST_ENV})
        one_cpu_producer()  # the actor reserves one CPU
        if config.runtime.pin_workers:
            claim_cpu()
        # The first pages of Ray's object store (``prefault_object_store``), where this worker's
        # chunks will be stored: on a thread of its own, so that the actor is ready at once.
        self._prefault = threading.Thread(target=self._prefault_store, args=(prefault_bytes,),
                                          name="prefault", daemon=True)
        self._prefault.start()
        self._config = config
        self._plan = plan
        self._name = name
        self._streams: dict[int, Stream] = {}
        self._metrics: WorkerMetrics | None = None

    def _prefault_store(self, nbytes: int) -> int:
        """Maps ``nbytes`` of the object store; returns the bytes mapped."""
        return prefault_shared("plasma", nbytes)

    def where(self) -> tuple[int, str]:
        """(process id, Ray node id); the pool asks it first, so its answer says the worker
        has started."""
        return os.getpid(), ray.get_runtime_context().get_node_id()

    def open(self, stream_id: int, state: dict[str, Any] | None,
             skip_rows: int = 0) -> int | WorkerError:
        """Opens (or reopens) a stream at ``state``, then drops ``skip_rows`` rows."""
        s = open_stream(self._config, self._plan, stream_id, self._tokenizer())
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
        t0 = time.perf_counter()
        out = self._call(stream_id, s.produce, n_rows)
        if isinstance(out, Chunk):
            if self._metrics is None:
                self._metrics = WorkerMetrics(self._name)
            self._metrics.record(out.num_rows, time.perf_counter() - t0)
        return out

    def produce_many(self, stream_ids: list[int], n_rows: int) -> list[Chunk | WorkerError]:
        """``produce`` for each stream, returned as one object (``streams_per_call``)."""
        return [self.produce(s, n_rows) for s in stream_ids]

    def produce_traced(self, stream_id: int, n_rows: int, mailbox) -> Chunk | WorkerError:
        """``produce``, tokenizing one document at a time and putting each one's place in
        ``mailbox`` (an ``actors.mailbox.Mailbox``) first: if a document kills this process,
        the host reads there which one it was (``actors.poison`` locating a poison document)."""
        s = self._streams[stream_id]
        s.set_trace(lambda where: ray.get(mailbox.put.remote(json.dumps(where)),
                                          timeout=TRACE_TIMEOUT_S))
        try:
            return self.produce(stream_id, n_rows)
        finally:
            s.set_trace(None)

    def _tokenizer(self):
        return load_tokenizer(self._config.tokenizer, self._config.runtime.tokenizer_backend)

    def _call(self, stream_id: int, fn, *args):
        try:
            return fn(*args)
        except BadInputError as e:
            # Errors travel as values so the host re-raises them with worker and stream named.
            return WorkerError(f"worker {self._name}, stream {stream_id}: {e}",
                               stream_id=stream_id, worker=self._name, cause=e)
        except (StreamError, OSError) as e:
            # Unexpected failures (a bug, a flaky filesystem) may pass on a fresh worker.
            return WorkerError(f"worker {self._name}, stream {stream_id}: {e}",
                               stream_id=stream_id, worker=self._name, cause=e, retryable=True)
        except ValueError as e:
            return WorkerError(f"worker {self._name}, stream {stream_id}: {e}",
                               stream_id=stream_id, worker=self._name, cause=e)
