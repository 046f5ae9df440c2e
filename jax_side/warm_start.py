"""Warm start: the host makes the first chunks itself while Ray starts, then hands every
stream to the worker pool where it is.

A local Ray cluster takes seconds to start, and its workers about one more. Until the pool
runs, ``WarmStartSource`` makes each stream's chunks in this process: the first of one step's
rows, at normal priority (the first batch, which the caller waits for), then each twice the
last, up to about 128k tokens, at low CPU priority (Linux), taking the CPU that Ray's start
leaves idle, not Ray's. A chunk costs a fixed part on top of its rows: on the demo, one core
made 7,800 - 8,000 rows a second in chunks of 2 rows and 14,700 in chunks of 128. Once the
workers answer, it notes where each stream is, ``(state, rows to skip)``, and opens the pool
there. A stream's rows depend only on its state, never on who makes them or in what chunks,
so the batches are those of the pool alone::

    stream s   | host: 1 step | host: 2 steps | host: 4 ... | pool: chunk | pool: chunk |
                                                            ^ handoff: pool.open(s, state, skip)

Errors of Ray's start or of the pool's are raised by the next chunk request.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ingest.config import CHUNK_TOKENS, Config
from ingest.plan import UnitPlan
from ingest.stream import Chunk
from jax_side.local_source import LocalSource

__all__ = ["WarmStartSource"]

log = logging.getLogger("ingest")

# The host thread's nice value while Ray starts, once the first batch's chunks are made: 10
# weighs about a tenth of a default thread.
HOST_NICE = 10


def _lower_priority() -> None:
    """Raises this thread's nice value (Linux: a thread is a task of its own; elsewhere the
    call would name a process, so nothing is done)."""
    if sys.platform == "linux":
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), HOST_NICE)
        except OSError:
            pass


class WarmStartSource:
    """A chunk source that is ``LocalSource`` until Ray's worker pool runs, then the pool.

    Args:
      config: the validated config.
      plan: the unit plan.
      stream_ids: the streams this host owns.
      await_ray: returns once Ray is up; raises what starting it raised.
      make_pool: builds the ``WorkerPool`` (called once Ray is up) for a number of workers.
      workers: Ray workers wanted (``request_resize`` before the pool runs changes it).
      step_rows: rows of the host's first chunk of each stream (a stream's rows of one step);
        each next one has twice the last, up to ``CHUNK_TOKENS // seq_len`` rows.
      get_timeout_s: the longest the workers may take to start.

    Attributes:
      host_rows: rows the host made.

    Once the pool runs, its attributes (``restarts``, ``workers``, ...) read through this
    object; before, they are missing.
    """

    def __init__(self, config: Config, plan: UnitPlan, stream_ids: list[int], *,
                 await_ray: Callable[[], None], make_pool: Callable[[int], Any], workers: int,
                 step_rows: int, get_timeout_s: float):
        self._new_local = lambda: LocalSource(config, plan, stream_ids)
        self._step_rows = max(1, step_rows)
        self._max_rows = max(self._step_rows, CHUNK_TOKENS // config.seq_len)
        self._next_rows: dict[int, int] = {}  # rows of each stream's next host chunk
        self._local: LocalSource | None = self._new_local()
        self._maker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="WarmStart-host")
        self._first_chunks: set[int] | None = set()  # streams with a chunk; None once lowered
        self._await_ray = await_ray
        self._make_pool = make_pool
        self._workers = workers
        self._streams = len(stream_ids)
        self._timeout = get_timeout_s
        # Where each stream is: (state, rows to skip) after the host's last chunk of it.
        self._at: dict[int, tuple[dict[str, Any] | None, int]] = {}
        self._lock = threading.Lock()  # the host's chunks against the handoff's reading of _at
        self._handing_off = False  # _at is read: the next chunks come from the pool
        self._opened = threading.Event()  # the pool is open at _at (or failed: _error)
        self._pool: Any = None  # the pool, once open
        self._error: BaseException | None = None
        self._closed = False
        self._waiting_for_ray = True  # the thread has not yet gone past _await_ray
        self.host_rows = 0
        self._thread = threading.Thread(target=self._start_pool, name="WarmStart", daemon=True)

    def open(self, states: dict[int, tuple[dict[str, Any] | None, int]]) -> None:
        self._maker.submit(self._local.open, states).result()
        self._at = dict(states)
        self._thread.start()

    def next_chunk(self, s: int) -> Chunk:
        if self._error is not None:
            raise self._error
        with self._lock:
            if not self._handing_off:
                c = self._maker.submit(self._make, s).result()
                self.host_rows += c.num_rows
                self._at[s] = (c.state_after, 0)
                return c
        if not self._opened.wait(self._timeout):
            raise TimeoutError(f"the Ray workers did not take over the streams within "
                               f"{self._timeout:.0f} s: check the cluster (`ray status`)")
        if self._error is not None:
            raise self._error
        return self._pool.next_chunk(s)

    def _make(self, s: int) -> Chunk:
        """Stream ``s``'s next chunk, on the maker thread, which lowers its priority once every
        stream has had one."""
        rows = self._next_rows.get(s, self._step_rows)
        self._next_rows[s] = min(2 * rows, self._max_rows)
        c = self._local.next_chunk(s, rows)
        if self._first_chunks is not None:
            self._first_chunks.add(s)
            if len(self._first_chunks) == self._streams:
                _lower_priority()
                self._first_chunks = None
        return c

    def _start_pool(self) -> None:
        """The thread: waits for Ray, builds the pool, waits for its workers, and opens every
        stream where the host is."""
        pool = None
        try:
            self._await_ray()
            with self._lock:
                self._waiting_for_ray = False
                if self._closed:
                    return
            pool = self._make_pool(self._workers)
            import ray  # noqa: PLC0415 (Ray is up by now)

            refs = [pool.location(w) for w in pool.workers]
            deadline = time.monotonic() + self._timeout
            while refs and not self._closed:
                _, refs = ray.wait(refs, num_returns=len(refs), timeout=0.1)
                if refs and time.monotonic() > deadline:
                    raise TimeoutError(f"{len(refs)} Ray workers did not start within "
                                       f"{self._timeout:.0f} s: check the cluster "
                                       f"(`ray status`) and the worker logs")
            with self._lock:
                if self._closed:
                    return
                self._handing_off = True
                at = dict(self._at)
                self._drop_local()
            pool.open(at)
            log.info("warm start: this process made %d rows while Ray started; %d workers "
                     "make the rest", self.host_rows, pool.num_workers)
            with self._lock:
                if not self._closed:
                    self._pool, pool = pool, None
        except BaseException as e:  # noqa: BLE001 -- raised by the next chunk request
            self._error = e
        finally:
            if pool is not None:
                pool.close()
            self._opened.set()

    @property
    def num_workers(self) -> int:
        """The pool's workers; before it runs, those it will start."""
        if self._pool is not None:
            return self._pool.num_workers
        return min(self._workers, self._streams)

    def request_resize(self, n: int) -> None:
        if self._pool is not None:
            self._pool.request_resize(n)
        else:
            self._workers = n

    def reopen(self, states: dict[int, tuple[dict[str, Any] | None, int]]) -> None:
        """Back to ``states`` on every stream (``reset_after_epoch``): on the pool once it
        runs, else on the host."""
        with self._lock:
            if not self._handing_off:
                self._local.close()
                self._local = self._new_local()
                self._maker.submit(self._local.open, states).result()
                self._at = dict(states)
                return
        if not self._opened.wait(self._timeout) or self._error is not None:
            raise RuntimeError("reset_after_epoch: the Ray workers never took over the streams"
                               ) from self._error
        self._pool.reopen(states)

    def _drop_local(self) -> None:
        """Ends the host's part (under ``_lock``)."""
        if self._local is not None:
            self._maker.shutdown(wait=False)
            self._local.close()
            self._local = None

    def close(self) -> None:
        """Ends the host's part and the pool (one still starting included: Ray may be shut
        down once this returns). A thread still waiting for Ray is not waited for: it makes no
        pool once Ray is up."""
        with self._lock:
            self._closed = True
            self._drop_local()
            waiting = self._waiting_for_ray
        if self._thread.is_alive() and not waiting:
            self._thread.join(self._timeout)
        if self._pool is not None:
            self._pool.close()

    def __getattr__(self, name: str) -> Any:
        # Only for attributes this class lacks: the pool's, once it runs.
        pool = self.__dict__.get("_pool")
        if pool is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(pool, name)
