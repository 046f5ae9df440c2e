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

from typing import Any

from actors.calls import get_within

__all__ = ["InFlightRequests"]


class InFlightRequests:
    """The request side of ``actors.pool.WorkerPool`` (mixed into it).

    Reads the pool's ``_config``, ``_depth``, ``_timeout``, ``_placement`` (stream -> worker)
    and ``_group`` (stream -> the streams one call may serve with it); keeps ``_queues``
    (stream -> deque of entries), ``_exhausted``, ``_solo`` (streams asked for alone),
    ``_fetched`` and the count ``requests``.
    """

    def _fill(self, s: int, depth: int | None = None, *, now: bool = False) -> None:
        """Requests chunks of stream ``s`` until ``depth`` are in flight.

        Queue entries are ``(ref, i)``: the chunk, or (``i`` not None) the i-th chunk of a
        grouped call. A grouped call covers the streams of ``s``'s group on its worker that
        need a chunk. The feed takes rows of every stream at the same pace, so a group's
        streams run out of chunks at the same step, one after another: while another stream
        of the group still holds its full queue, ``s`` leaves the request to it, unless ``now``
        (``s`` needs a chunk at once).
        """
        depth = depth or self._depth
        q = self._queues[s]
        w = self._placement[s]
        rows = self._config.chunk_rows
        while len(q) < depth and s not in self._exhausted:
            if len(self._group[s]) == 1 or s in self._solo:
                self.requests += 1
                q.append((w.produce.remote(s, rows), None))
                continue
            members = [t for t in self._group[s] if self._placement[t] is w
                       and t not in self._exhausted and t not in self._solo]
            need = [t for t in members if len(self._queues[t]) < depth]
            if len(need) < len(members) and not now:
                return
            self.requests += 1
            ref = w.produce_many.remote(need, rows)
            for i, t in enumerate(need):
                self._queues[t].append((ref, i))
            now = False  # the rest may wait for the group again

    def _take(self, entry, s: int) -> Any:
        """The chunk (or WorkerError) a queue entry of stream ``s`` names."""
        ref, i = entry
        if i is None:
            return get_within(ref, self._timeout, f"a chunk of stream {s}")
        if self._fetched is None or self._fetched[0] != ref:
            self._fetched = (ref, list(get_within(ref, self._timeout, f"a chunk of stream {s}")))
        chunks = self._fetched[1]
        out, chunks[i] = chunks[i], None  # held by the feed from here on, not by this cache
        if all(c is None for c in chunks):
            self._fetched = None
        return out
