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

from typing import Any

from ingest.config import Config

__all__ = ["group_streams", "place_groups", "pool_size"]


def pool_size(config: Config, num_workers: int, streams: int) -> int:
    """Workers a pool of ``streams`` streams starts with: ``num_workers``, at most one per
    stream (one more would have nothing to do), within the autoscale bounds when
    ``config.autoscale``."""
    n = min(num_workers, streams)
    if config.autoscale:
        n = max(config.min_workers, min(config.max_workers or n, n))
        n = min(n, streams)
    return n


def group_streams(stream_ids: list[int], per_call: int) -> dict[int, tuple[int, ...]]:
    """Each stream's group: ``per_call`` consecutive streams (the last group may be short)."""
    g = per_call
    return {s: tuple(stream_ids[i - i % g:i - i % g + g]) for i, s in enumerate(stream_ids)}


def place_groups(stream_ids: list[int], per_call: int, workers: list[Any]) -> dict[int, Any]:
    """Each stream's worker: the groups of ``group_streams`` dealt to ``workers`` in turn."""
    return {s: workers[(i // per_call) % len(workers)] for i, s in enumerate(stream_ids)}
