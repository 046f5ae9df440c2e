"""The ``local`` backend's chunk source: a host's streams run in this process, without Ray."""

from __future__ import annotations

import time

from ingest.config import Config
from ingest.plan.build import UnitPlan
from ingest.runtime import resolve_runtime
from ingest.stream.chunk import SourceStats, StartAt
from ingest.stream.kinds import Chunk, open_stream

__all__ = ["LocalSource"]


class LocalSource:
    """The ``local`` backend (an ``ingest.stream.chunk.ChunkSource``): the same streams, run in this
    process, without Ray."""

    def __init__(self, config: Config, plan: UnitPlan, stream_ids: list[int], *,
                 rows: int | None = None):
        self._config = config
        self._plan = plan
        self._rows = rows or resolve_runtime(config).in_process_chunk_rows  # rows per chunk
        self._streams = {s: open_stream(config, plan, s) for s in stream_ids}
        self._started_at = time.perf_counter()
        self._chunks = 0
        self._wait_s = 0.0

    def open(self, states: dict[int, StartAt]) -> None:
        for s, (st, skip) in states.items():
            if st is not None:
                self._streams[s].set_state(st)
            if skip:
                self._streams[s].produce(skip)

    def reopen(self, states: dict[int, StartAt]) -> None:
        """Every stream of ``states`` made afresh, then opened there."""
        for s in states:
            self._streams[s] = open_stream(self._config, self._plan, s)
        self.open(states)

    def next_chunk(self, s: int, rows: int | None = None) -> Chunk:
        """Stream ``s``'s next chunk: ``rows`` rows (default: this source's chunk rows), fewer
        where the stream ends."""
        t0 = time.perf_counter()
        c = self._streams[s].produce(rows or self._rows)
        self._wait_s += time.perf_counter() - t0
        self._chunks += 1
        return c

    def request_resize(self, n: int) -> None:
        raise ValueError(f"resize to {n} workers needs backend='ray'; the local backend runs "
                         f"the streams in this process, without workers")

    def stats(self) -> SourceStats:
        return SourceStats(chunks_received=self._chunks, wait_s=self._wait_s,
                           started_at=self._started_at)

    def close(self) -> None:
        self._streams.clear()
