"""The chunk requests in flight: a bounded FIFO of requests per stream, and the replies taken
from them in order.

A stream's queue holds ``(ref, i)`` entries: the chunk itself (``i`` None), or the ``i``-th
chunk of a grouped call (``streams_per_call``) that made the next chunks of several streams of
one worker::

    stream 0: (r7, 0) (r9, 0)       r7 = produce_many([0, 1]), r9 = the next such call
    stream 1: (r7, 1) (r9, 1)
    stream 2: (r8, None)            r8 = produce(2): stream 2 is asked for alone

The host holds the refs, so it owns the chunks: a chunk already produced survives its worker.
"""

from __future__ import annotations

import collections
from typing import Any

from actors.calls import get_within
from actors.placement import Placement

__all__ = ["InFlightRequests"]


class InFlightRequests:
    """The chunk requests in flight of a pool's streams, up to ``depth`` per stream.

    Args:
      placement: the pool's workers and which runs each stream (read here).
      stream_ids: the streams.
      chunk_rows: rows per chunk asked for.
      depth: requests in flight per stream.
      timeout_s: how long one reply may take.

    Attributes:
      requests: actor calls for chunks made (one per chunk, or per group of them).
    """

    def __init__(self, placement: Placement, stream_ids: list[int], *, chunk_rows: int,
                 depth: int, timeout_s: float):
        self._placement = placement
        self._rows = chunk_rows
        self.depth = depth
        self._timeout = timeout_s
        self._queues: dict[int, collections.deque] = {s: collections.deque()
                                                      for s in stream_ids}
        self._exhausted: set[int] = set()
        # Streams asked for alone until they deliver a chunk: those of a worker that died. A
        # grouped call that kills its worker fails every stream of the group, and the failures
        # must land on the stream whose document kills it (poison documents).
        self._solo: set[int] = set()
        # The result of the last grouped call fetched, which the group's other streams take
        # their chunks from next: (ref, chunks).
        self._fetched: tuple[Any, list] | None = None
        self.requests = 0

    def fill(self, s: int, depth: int | None = None, *, now: bool = False) -> None:
        """Requests chunks of stream ``s`` until ``depth`` are in flight.

        Queue entries are ``(ref, i)``: the chunk, or (``i`` not None) the i-th chunk of a
        grouped call. A grouped call covers the streams of ``s``'s group on its worker that
        need a chunk. The feed takes rows of every stream at the same pace, so a group's
        streams run out of chunks at the same step, one after another: while another stream
        of the group still holds its full queue, ``s`` leaves the request to it, unless ``now``
        (``s`` needs a chunk at once).
        """
        depth = depth or self.depth
        q = self._queues[s]
        place = self._placement
        w = place.worker_of(s)
        while len(q) < depth and s not in self._exhausted:
            group = place.group_of(s)
            if len(group) == 1 or s in self._solo:
                self.requests += 1
                q.append((w.produce.remote(s, self._rows), None))
                continue
            members = [t for t in group if place.worker_of(t) is w
                       and t not in self._exhausted and t not in self._solo]
            need = [t for t in members if len(self._queues[t]) < depth]
            if len(need) < len(members) and not now:
                return
            self.requests += 1
            ref = w.produce_many.remote(need, self._rows)
            for i, t in enumerate(need):
                self._queues[t].append((ref, i))
            now = False  # the rest may wait for the group again

    def refill(self, streams: list[int]) -> None:
        """Fills the queues of ``streams`` (those not ended) to the full depth."""
        for t in streams:
            self.fill(t)

    def next_reply(self, s: int) -> Any:
        """The reply to stream ``s``'s oldest request (asked for now if none is in flight):
        a chunk or a WorkerError; raises what ``ray.get`` raises for a lost worker."""
        q = self._queues[s]
        if not q:
            self.fill(s, now=True)
        ref, i = q.popleft()
        if i is None:
            return get_within(ref, self._timeout, f"a chunk of stream {s}")
        if self._fetched is None or self._fetched[0] != ref:
            self._fetched = (ref, list(get_within(ref, self._timeout, f"a chunk of stream {s}")))
        chunks = self._fetched[1]
        out, chunks[i] = chunks[i], None  # held by the feed from here on, not by this cache
        if all(c is None for c in chunks):
            self._fetched = None
        return out

    def delivered(self, s: int, exhausted: bool) -> None:
        """Stream ``s`` delivered a chunk (its last if ``exhausted``): asks for the next."""
        self._solo.discard(s)
        if exhausted:
            self._exhausted.add(s)
            # Requests already queued behind the last chunk return empty chunks; drop them.
            self._queues[s].clear()
        else:
            self.fill(s)

    def drop(self, streams: list[int], *, alone: bool = False) -> None:
        """Drops the requests of ``streams`` (moved to another worker); with ``alone``, they
        are asked for one at a time until each delivers a chunk."""
        for t in streams:
            self._queues[t].clear()
        if alone:
            self._solo.update(streams)

    def drop_all(self) -> None:
        """Drops every request, and forgets which streams ended (a pass restarted)."""
        for q in self._queues.values():
            q.clear()
        self._fetched = None
        self._exhausted.clear()

    def ended(self, s: int) -> bool:
        return s in self._exhausted

    def queued(self, s: int) -> int:
        return len(self._queues[s])

    def total(self) -> int:
        """Requests in flight, all streams together."""
        return sum(len(q) for q in self._queues.values())

    def refs(self) -> list:
        """The distinct refs in flight."""
        return list(dict.fromkeys(ref for q in self._queues.values() for ref, _ in q))
