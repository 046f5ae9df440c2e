"""Placement: how many workers a pool starts, and which worker runs which streams.

Streams are cut into groups of ``streams_per_call`` consecutive ids (one actor call makes the
next chunk of every stream of a group: fewer calls and objects), and the groups are dealt to
the running workers in turn::

    streams 0..7 on 2 workers, streams_per_call 4:   w0 <- (0 1 2 3)         w1 <- (4 5 6 7)
    streams 0..7 on 3 workers, streams_per_call 2:   w0 <- (0 1) (6 7)  w1 <- (2 3)  w2 <- (4 5)

``streams_per_call`` is at most a worker's share of the streams, so that every worker gets a
group (``ingest.config.streams_per_call_for``). After a resize or a replacement a group's
streams may sit on different workers; each worker's part is then asked for on its own.
"""

from __future__ import annotations

import collections
from typing import Any

from ingest.config import Config

__all__ = ["group_streams", "idle_workers", "place_groups", "pool_size", "uneven_share"]


def pool_size(config: Config, num_workers: int, streams: int) -> int:
    """Workers a pool of ``streams`` streams starts with: ``num_workers``, at most one per
    stream (one more would have nothing to do), within the autoscale bounds when
    ``config.autoscale``."""
    n = min(num_workers, streams)
    if config.autoscale:
        n = max(config.min_workers, min(config.max_workers or n, n))
        n = min(n, streams)
    return n


def idle_workers(num_workers: int, streams: int, num_streams: int) -> str | None:
    """Why fewer than ``num_workers`` workers start for a host's ``streams`` streams (of
    ``num_streams`` in all), or None where all of them start."""
    if num_workers <= streams:
        return None
    which = "streams" if streams == num_streams else f"streams (this host's, of {num_streams})"
    return (f"workers={num_workers} on {streams} {which}: {streams} workers start, one per "
            f"stream, as a stream is made by one worker at a time. For all {num_workers} to "
            f"work, use a num_streams that is a multiple of {num_workers} (that changes the "
            f"batches)")


def group_streams(stream_ids: list[int], per_call: int) -> dict[int, tuple[int, ...]]:
    """Each stream's group: ``per_call`` consecutive streams (the last group may be short)."""
    g = per_call
    return {s: tuple(stream_ids[i - i % g:i - i % g + g]) for i, s in enumerate(stream_ids)}


def place_groups(stream_ids: list[int], per_call: int, workers: list[Any]) -> dict[int, Any]:
    """Each stream's worker: the groups of ``group_streams`` dealt to ``workers`` in turn."""
    return {s: workers[(i // per_call) % len(workers)] for i, s in enumerate(stream_ids)}


def uneven_share(placement: dict[int, Any], workers: int) -> tuple[float, str] | None:
    """Where ``workers`` workers holding the streams of ``placement`` (stream -> worker) hold
    unequal shares: what they make, in evenly loaded workers, and a line saying why and what to
    change; None where every worker holds as many streams.

    Every batch takes rows of every stream, so a pool goes at the pace of its busiest worker:
    16 streams on 15 workers (one holds two) make what 8 workers make.
    """
    counts = collections.Counter(id(w) for w in placement.values())
    streams = len(placement)
    busiest = max(counts.values(), default=0)
    lightest = min(counts.values()) if len(counts) >= workers else 0
    if busiest == lightest:
        return None
    even = [d for d in range(1, streams + 1) if streams % d == 0]
    fewer = max(d for d in even if d <= workers)
    more = min((d for d in even if d > workers), default=None)
    choice = f"{fewer} or {more} workers" if more else f"{fewer} workers"
    pace = streams / busiest
    return pace, (f"{streams} streams on {workers} workers: the busiest worker holds "
                  f"{busiest} streams and the lightest {lightest}; every batch takes rows of "
                  f"every stream, so the pool makes what {pace:.1f} evenly loaded workers "
                  f"make. For an even share use {choice} (num_streams divides by them), or a "
                  f"num_streams that {workers} divides (that changes the batches)")
