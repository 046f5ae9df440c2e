"""Prefetch: a background thread assembles steps ahead of the consumer and hands them over.

The thread calls the feed's ``next_items`` until it returns ``END`` or is stopped, and puts
each item into a ``Handoff`` of at most ``device_prefetch`` items; an exception on the thread
is handed over as the last item and re-raised on the consumer's thread::

    producer thread:  step 1 -> step 2 -> step 3 -> (full: polls for room) ... -> END
    consumer:         get() -> step 1, get() -> step 2, ...
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["END", "Handoff", "Prefetcher"]

END = object()
"""The item after the last step of a pass."""


class Handoff:
    """The finished batches between the assembly thread and the consumer, at most ``size``.

    The consumer's side never wakes the other thread: ``queue.Queue.get`` (and a semaphore
    release) wakes a producer blocked on a full queue from inside the consumer's call, which
    puts the wake-up on the consumer's time. Here the consumer takes a ready batch from a
    deque and notes the time, and a producer that is ahead polls for room: every eighth of
    the consumer's shortest recent time between batches, within 1 - 20 ms, so that a long
    training step is not polled a thousand times a second, each poll taking the GIL. The
    shortest of the last ``_GAPS``
    times keeps a pause (a checkpoint, an evaluation) from slowing the polls after it.
    """

    _POLL_MIN_S = 0.001
    _POLL_MAX_S = 0.02
    _GAPS = 4

    def __init__(self, size: int):
        self._size = max(1, size)
        self._items: collections.deque = collections.deque()
        self._ready = threading.Event()
        self._last_take: float | None = None
        self._gaps: tuple[float, ...] = ()  # replaced whole: the producer reads it as is
        self.polls = 0  # the producer's looks for room (waits on a full handoff)

    def poll_s(self) -> float:
        """How long a producer that is ahead waits between looks for room."""
        if len(self._gaps) < self._GAPS:
            return self._POLL_MIN_S
        return min(max(min(self._gaps) / 8, self._POLL_MIN_S), self._POLL_MAX_S)

    def put(self, item: Any, stop: threading.Event) -> bool:
        """Adds ``item`` once there is room; False if ``stop`` was set first."""
        while len(self._items) >= self._size:
            self.polls += 1
            if stop.wait(self.poll_s()):
                return False
        if stop.is_set():
            return False
        self.put_now(item)
        return True

    def put_now(self, item: Any) -> None:
        """Adds ``item`` even when full (the producer's last one: an error)."""
        self._items.append(item)
        self._ready.set()

    def get(self, timeout_s: float) -> Any:
        """The next item; raises ``queue.Empty`` after ``timeout_s``."""
        deadline = None
        while not self._items:
            if deadline is None:
                deadline = time.monotonic() + timeout_s
            self._ready.clear()
            # put_now appends before it sets: an item added since the check above is seen
            # here, or sets the event after the clear. A set can also come late, for an item
            # this consumer already took (the producer paused between its append and its
            # set), so a wake-up is checked against the deque, never trusted alone.
            if self._items:
                break
            left = deadline - time.monotonic()
            if left <= 0 or not self._ready.wait(left):
                if self._items:
                    break
                raise queue.Empty
        now = time.monotonic()
        if self._last_take is not None:
            self._gaps = (*self._gaps[1 - self._GAPS:], now - self._last_take)
        self._last_take = now
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items


class Prefetcher:
    """One pass's producer thread and its handoff.

    Args:
      size: finished items kept ready (``device_prefetch``).
      next_items: called on the thread for the next items to hand over: a step, or items
        ending with ``END`` (the thread then ends). It is not called once ``stop`` was asked.
    """

    def __init__(self, size: int, next_items: Callable[[], list[Any]]):
        self._handoff = Handoff(size)
        self._stop = threading.Event()
        self._next_items = next_items
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="HostFeed", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                items = self._next_items()
                for i, item in enumerate(items):
                    if not self._handoff.put(item, self._stop):
                        # Stopped: the items made stay for ``drain``, which counts their rows.
                        for rest in items[i:]:
                            self._handoff.put_now(rest)
                        return
                if items[-1] is END:
                    return
        except BaseException as e:  # noqa: BLE001 -- re-raised on the consumer's thread
            self._handoff.put_now(e)

    def get(self) -> Any:
        """The next item: a step, ``END``, or the exception that ended the thread."""
        while True:
            try:
                return self._handoff.get(timeout_s=1.0)
            except queue.Empty:
                if not self._thread.is_alive() and self._handoff.empty():
                    raise RuntimeError("the HostFeed producer thread died without a message; "
                                       "this is a bug in jax_side.feed") from None

    def stop(self, timeout_s: float) -> bool:
        """Stops the thread; whether it ended within ``timeout_s`` (True if never started)."""
        self._stop.set()
        if self._thread is None:
            return True
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()

    def drain(self) -> list[Any]:
        """The items made but not taken, those the stop kept from the handoff too (once the
        thread has stopped)."""
        items = []
        while not self._handoff.empty():
            items.append(self._handoff.get(timeout_s=0))
        return items
