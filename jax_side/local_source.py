"""The ``local`` backend's chunk source: a host's streams run in this process, without Ray."""

from __future__ import annotations

import time
from typing import Any

from ingest.config import Config
from ingest.plan import UnitPlan
from ingest.stream import Chunk, open_stream

__all__ = ["LocalSource"]


class LocalSource:
    """The ``local`` backend: the same streams, run in this process, without Ray."""

    def __init__(self, config: Config, plan: UnitPlan, stream_ids: list[int], *,
                 rows: int | None = None):
        self._config = config
        self._rows = rows or config.in_process_chunk_rows  # rows per chunk
        self._streams = {s: open_stream(config, plan, s) for s in stream_ids}
        self.num_workers = 0
        self.wait_s = 0.0

    def open(self, states: dict[int, tuple[dict[str, Any] | None, int]]) -> None:
        for s, (st, skip) in states.items():
            if st is not None:
                self._streams[s].set_state(st)
            if skip:
                self._streams[s].produce(skip)

    def next_chunk(self, s: int, rows: int | None = None) -> Chunk:
        """Stream ``s``'s next chunk: ``rows`` rows (default: this source's chunk rows), fewer
        where the stream ends."""
        t0 = time.perf_counter()
        c = self._streams[s].produce(rows or self._rows)
        self.wait_s += time.perf_counter() - t0
        return c

    def close(self) -> None:
        self._streams.clear()
