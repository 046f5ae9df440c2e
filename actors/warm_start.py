"""Warm start: the host makes the first chunks itself while Ray starts, then hands every
stream to the worker pool where it is.

A local Ray cluster takes seconds to start, and its workers about one more. Until the pool runs,
``WarmStartSource`` makes each stream's chunks in this process, on a thread of its own that
keeps one chunk of every stream ready ahead of the caller: the first of one step's rows, at
normal priority (the first batch, which the caller waits for), then each twice the last, up to
about 128k tokens, at low CPU priority (Linux), taking the CPU that Ray's start leaves idle, not
Ray's. A chunk costs a fixed part on top of its rows, so later chunks grow. Once the workers
answer, it notes
where each stream is after the chunks made, ``(state, rows to skip)``, and opens the pool there;
the caller takes the chunks made first, while the pool makes its own, and a chunk still being
made is dropped. A stream's rows depend only on its state, never on who makes them or in what
chunks, so the batches are those of the pool alone::

    stream s   | host: 1 step | host: 2 steps | host: 4 ... | pool: chunk | pool: chunk |
                                                            ^ handoff: pool.open(s, state, skip)

Errors of Ray's start or of the pool's are raised by the next chunk request.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ingest.config import Config
from ingest.plan.build import UnitPlan
from ingest.runtime import CHUNK_TOKENS
from ingest.stream.chunk import ChunkSource, SourceStats, StartAt
from ingest.stream.kinds import Chunk
from ingest.stream.local_source import LocalSource

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
    """A chunk source (``ingest.stream.chunk.ChunkSource``) that is ``LocalSource`` until Ray's
    worker pool runs, then the pool.

    Args:
      config: the validated config.
      plan: the unit plan.
      stream_ids: the streams this host owns.
      await_ray: returns once Ray is up; raises what starting it raised.
      make_pool: builds the ``WorkerPool`` (called once Ray is up) for a number of workers;
        it must have ``workers`` and ``location(worker)`` besides the ``ChunkSource`` methods.
      workers: Ray workers wanted (``request_resize`` before the pool runs changes it).
      step_rows: rows of the host's first chunk of each stream (a stream's rows of one step);
        each next one has twice the last, up to ``CHUNK_TOKENS // seq_len`` rows.
      get_timeout_s: the longest the workers may take to start.

    Attributes:
      host_rows: rows the host made (and handed out or holds).
    """

    def __init__(self, config: Config, plan: UnitPlan, stream_ids: list[int], *,
                 await_ray: Callable[[], None], make_pool: Callable[[int], ChunkSource],
                 workers: int,
                 step_rows: int, get_timeout_s: float):
        self._new_local = lambda: LocalSource(config, plan, stream_ids)
        self._step_rows = max(1, step_rows)
        self._max_rows = max(self._step_rows, CHUNK_TOKENS // config.seq_len)
        self._await_ray = await_ray
        self._make_pool = make_pool
        self._workers = workers
        self._streams = list(stream_ids)
        self._timeout = get_timeout_s
        # Everything below is guarded by _cv, the maker thread's and the handoff's included.
        self._cv = threading.Condition()
        self._local: LocalSource | None = None
        self._epoch = 0  # counts reopens: a chunk begun before one is dropped
        self._next_rows: dict[int, int] = {}  # rows of each stream's next host chunk
        self._made: dict[int, int] = {}  # host chunks made of each stream since the (re)open
        self._ready: dict[int, collections.deque[Chunk]] = {}  # made, not yet handed out
        self._failed: dict[int, BaseException] = {}  # a stream's chunk raised this
        self._ended: set[int] = set()  # streams whose last chunk the host made
        self._wanted: int | None = None  # the stream the caller waits for
        # Where each stream is: (state, rows to skip) after the host's last chunk of it.
        self._at: dict[int, StartAt] = {}
        self._lowered = False  # the maker runs at HOST_NICE (every stream has had a chunk)
        self._handing_off = False  # _at is read: the next chunks past _ready are the pool's
        self._opened = threading.Event()  # the pool is open at _at (or failed: _error)
        self._pool: Any = None  # the pool (a ChunkSource), once open
        self._started_at = time.perf_counter()
        self._error: BaseException | None = None
        self._closed = False
        self._waiting_for_ray = True  # the thread has not yet gone past _await_ray
        self.host_rows = 0
        self._maker = threading.Thread(target=self._make_ahead, name="WarmStart-host",
                                       daemon=True)
        self._thread = threading.Thread(target=self._start_pool, name="WarmStart", daemon=True)

    def open(self, states: dict[int, StartAt]) -> None:
        with self._cv:
            self._open_local(states)
        self._maker.start()
        self._thread.start()

    def _open_local(self, states: dict[int, StartAt]) -> None:
        """A fresh ``LocalSource`` at ``states`` (under ``_cv``)."""
        if self._local is not None:
            self._local.close()
        self._local = self._new_local()
        self._local.open(states)
        self._epoch += 1
        self._at = dict(states)
        self._next_rows = {}
        self._made = {s: 0 for s in self._streams}
        self._ready = {s: collections.deque() for s in self._streams}
        self._failed = {}
        self._ended = set()
        self._wanted = None
        self._cv.notify_all()

    def next_chunk(self, s: int) -> Chunk:
        with self._cv:
            while True:
                if self._error is not None:
                    raise self._error
                if self._closed:
                    raise RuntimeError("the warm start's source is closed")
                if self._ready[s]:
                    c = self._ready[s].popleft()
                    self._cv.notify_all()  # the maker may make the next one
                    return c
                if s in self._failed:
                    raise self._failed[s]
                if self._handing_off:
                    break
                self._wanted = s
                self._cv.notify_all()
                self._cv.wait()
        if not self._opened.wait(self._timeout):
            raise TimeoutError(f"the Ray workers did not take over the streams within "
                               f"{self._timeout:.0f} s: check the cluster (`ray status`)")
        if self._error is not None:
            raise self._error
        return self._pool.next_chunk(s)

    def _next_to_make(self) -> int | None:
        """The stream whose next chunk the maker makes now (under ``_cv``): the one the caller
        waits for, else, one chunk ahead of the caller, the stream with the fewest chunks made
        (the caller takes every stream's rows in step, so that is the one it needs first)."""
        w = self._wanted
        if w is not None and not self._ready[w] and w not in self._failed:
            return w  # (a stream that ended: its next chunk is empty, and says so)
        ahead = [s for s in self._streams
                 if not self._ready[s] and s not in self._failed and s not in self._ended]
        return min(ahead, key=lambda s: self._made[s]) if ahead else None

    def _stopped(self) -> bool:
        """Whether the host makes no more chunks (under ``_cv``)."""
        return self._closed or self._handing_off or self._error is not None

    def _make_ahead(self) -> None:
        """The maker thread: makes each stream's next chunk while the caller uses the last
        one, until the handoff; its priority drops once every stream has had one."""
        while True:
            with self._cv:
                while not self._stopped() and (s := self._next_to_make()) is None:
                    self._cv.wait()
                if self._stopped():
                    return
                epoch, local = self._epoch, self._local
                rows = self._next_rows.get(s, self._step_rows)
                self._next_rows[s] = min(2 * rows, self._max_rows)
                self._made[s] += 1
            c = error = None
            try:
                c = local.next_chunk(s, rows)
            except BaseException as e:  # noqa: BLE001 -- raised by the caller's next request
                error = e
            with self._cv:
                self._cv.notify_all()
                if epoch != self._epoch or self._stopped():
                    continue  # a chunk of a pass reopened since, or of a stream handed off
                if error is not None:
                    self._failed[s] = error
                    continue
                self._ready[s].append(c)
                self.host_rows += c.num_rows
                self._at[s] = (c.state_after, 0)
                if c.exhausted:
                    self._ended.add(s)
                if s == self._wanted:
                    self._wanted = None
                lower = not self._lowered and all(self._made.values())
                self._lowered = self._lowered or lower
            if lower:
                _lower_priority()

    def _start_pool(self) -> None:
        """The thread: waits for Ray, builds the pool, waits for its workers, and opens every
        stream where the host is."""
        pool = None
        try:
            self._await_ray()
            with self._cv:
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
            with self._cv:
                if self._closed:
                    return
                # The chunks the host made stay the caller's; a chunk still being made is
                # dropped, and the pool makes it.
                self._handing_off = True
                at = dict(self._at)
                self._drop_local()
            pool.open(at)
            log.info("warm start: this process made %d rows while Ray started; %d workers "
                     "make the rest", self.host_rows, pool.num_workers)
            with self._cv:
                if not self._closed:
                    self._pool, pool = pool, None
        except BaseException as e:  # noqa: BLE001 -- raised by the next chunk request
            with self._cv:
                self._error = e
                self._cv.notify_all()
        finally:
            if pool is not None:
                pool.close()
            self._opened.set()

    def stats(self) -> SourceStats:
        """The pool's counters once it runs; before, the workers it will start. Both with the
        rows this process made."""
        if self._pool is not None:
            return dataclasses.replace(self._pool.stats(), host_rows=self.host_rows)
        return SourceStats(num_workers=min(self._workers, len(self._streams)),
                           host_rows=self.host_rows, started_at=self._started_at,
                           warming=True)

    def request_resize(self, n: int) -> None:
        if self._pool is not None:
            self._pool.request_resize(n)
        else:
            self._workers = n

    def reopen(self, states: dict[int, StartAt]) -> None:
        """Back to ``states`` on every stream (``reset_after_epoch``): on the pool once it
        runs, else on the host."""
        with self._cv:
            if not self._handing_off:
                self._open_local(states)
                return
        if not self._opened.wait(self._timeout) or self._error is not None:
            raise RuntimeError("reset_after_epoch: the Ray workers never took over the streams"
                               ) from self._error
        self._pool.reopen(states)

    def _drop_local(self) -> None:
        """Ends the host's part (under ``_cv``): the maker stops, and a chunk it is making is
        dropped."""
        if self._local is not None:
            self._local.close()
            self._local = None
        self._cv.notify_all()

    def close(self) -> None:
        """Ends the host's part and the pool (one still starting included: Ray may be shut
        down once this returns). A thread still waiting for Ray is not waited for: it makes no
        pool once Ray is up. The host's chunk being made, if any, is waited for."""
        with self._cv:
            self._closed = True
            self._drop_local()
            waiting = self._waiting_for_ray
        if self._maker.is_alive():
            # The chunk being made is waited for (then dropped): the tokenizer's and Arrow's
            # native code must not run while the interpreter exits.
            self._maker.join(self._timeout)
        if self._thread.is_alive() and not waiting:
            self._thread.join(self._timeout)
        if self._pool is not None:
            self._pool.close()
