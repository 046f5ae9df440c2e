"""Chunk intake: the chunks of a host's owned streams and where the host is in each stream.

A chunk source (``ingest.stream.chunk.ChunkSource``: Ray's ``actors.pool.WorkerPool``, the warm
start, or ``LocalSource`` in this process) gives the next chunk of a stream on request. ``ChunkIntake`` keeps one ``StreamCursor`` per owned
stream and copies rows from the current chunks into a batch; a stream's state is saved at chunk
ends, so a cursor is that state plus the rows taken past it::

    stream s   | chunk (state_after = A) | chunk (state_after = B) |
                         taken: 2 ^          -> snapshot {state: A, taken: 2}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ingest.config import Config
from ingest.plan.build import UnitPlan
from ingest.runtime import resolve_runtime
from ingest.stream.chunk import ChunkSource
from ingest.stream.chunk_format import FIELDS, RowPieces, batch_groups
from ingest.stream.kinds import Chunk
from ingest.stream.local_source import LocalSource
from jax_side.feed_stats import PoolStats

__all__ = ["ChunkIntake", "ChunkSource", "LocalSource", "StreamCursor"]


@dataclasses.dataclass
class StreamCursor:
    """Where one stream is in the host's view: ``base`` is the state after the last chunk fully
    taken (None: the stream's beginning); ``extra`` rows past it were skipped on restore, and
    ``taken`` rows of the current chunk were used. ``documents``: the stream's documents
    counter after ``base`` and ``extra`` (None: ``base``'s own)."""

    base: dict[str, Any] | None = None
    extra: int = 0
    chunk: Chunk | None = None
    taken: int = 0
    documents: int | None = None
    # The current chunk's rows, and its documents counter by row as a list (read at every
    # step's snapshot: a list item, not a numpy scalar from memory another process wrote).
    rows: int = 0
    chunk_documents: list[int] | None = None

    def start(self, chunk: Chunk) -> None:
        """Makes ``chunk`` the current chunk, none of its rows taken."""
        self.chunk, self.taken, self.rows = chunk, 0, chunk.num_rows
        self.chunk_documents = None if chunk.documents is None else chunk.documents.tolist()

    def finish(self) -> None:
        """Past the current chunk, all of it taken: its end state is the new base."""
        self.base, self.extra, self.documents = self.chunk.state_after, 0, None
        self.chunk, self.taken, self.rows, self.chunk_documents = None, 0, 0, None

    def passed(self) -> int:
        """The stream's documents counter after the rows taken (states are saved at chunk
        ends; chunks count documents by row)."""
        if self.taken and self.chunk_documents is not None:
            return self.chunk_documents[self.taken - 1]
        if self.documents is not None:
            return self.documents
        return int((self.base or {}).get("documents", 0))

    def snapshot(self) -> dict[str, Any]:
        if self.chunk is not None and self.taken == self.rows:
            return {"state": self.chunk.state_after, "taken": 0, "documents": self.passed()}
        return {"state": self.base, "taken": self.extra + self.taken, "documents": self.passed()}


class ChunkIntake:
    """The owned streams' cursors and the source of their chunks.

    Args:
      config: the validated config.
      plan: the unit plan.
      streams: the stream ids this host owns.
      backend: ``ray`` (a ``WorkerPool``; Ray must be initialized) or ``local``.
      workers: Ray worker actors of the pool.
      get_timeout_s: the longest one chunk may take (ray).
      await_ray: returns once Ray is up (raises what starting it raised). Given, the host
        makes the first chunks itself until the pool's workers run (``actors.warm_start``).
      step_rows: rows of each stream per step (the host's chunks while Ray starts).

    Attributes:
      cursors: each owned stream's ``StreamCursor``.
      source: the running chunk source; None before ``open`` and after ``close``.
      pool_stats: the source's counters, kept over ``close``.
    """

    def __init__(self, config: Config, plan: UnitPlan, streams: tuple[int, ...], *,
                 backend: str, workers: int, get_timeout_s: float,
                 await_ray: Callable[[], None] | None = None, step_rows: int = 1):
        self.config = config
        self.plan = plan
        self.streams = streams
        self.backend = backend
        self.workers = workers
        self._timeout = get_timeout_s
        self._await_ray = await_ray
        self._step_rows = step_rows
        self.cursors = {s: StreamCursor() for s in streams}
        self.source: ChunkSource | None = None
        self.pool_stats = PoolStats()

    def open(self) -> None:
        """Starts the source at the cursors (once; later calls do nothing)."""
        if self.source is not None:
            return
        ids = list(self.streams)
        if self.backend == "local":
            src: ChunkSource = LocalSource(self.config, self.plan, ids)
        else:
            from actors.ray_cluster import import_ray  # noqa: PLC0415

            import_ray()  # a Ray that does not import fails here, saying so
            from actors.pool import WorkerPool  # noqa: PLC0415 (Ray only when asked for)

            def make_pool(workers: int) -> WorkerPool:
                return WorkerPool(self.config, self.plan, ids, num_workers=workers,
                                  get_timeout_s=self._timeout)

            if self._await_ray is not None:
                from actors.warm_start import WarmStartSource  # noqa: PLC0415

                src = WarmStartSource(self.config, self.plan, ids, await_ray=self._await_ray,
                                      make_pool=make_pool, workers=self.workers,
                                      step_rows=self._step_rows, get_timeout_s=self._timeout)
            else:
                src = make_pool(self.workers)
        src.open({s: (c.base, c.extra) for s, c in self.cursors.items()})
        self.source = src

    def restore(self, entries: dict[str, Any]) -> None:
        """Sets every cursor from a saved state's ``streams`` (which holds them all)."""
        for s in self.streams:
            st = entries[str(s)]
            self.cursors[s] = StreamCursor(base=st["state"], extra=int(st["taken"]),
                                           documents=st.get("documents"))

    def rewind(self) -> None:
        """Back to every stream's beginning; the source starts the pass again (a Ray pool on
        the workers it has: no new actors per pass)."""
        self.cursors = {s: StreamCursor() for s in self.streams}
        if self.source is not None:
            self.source.reopen({s: (None, 0) for s in self.streams})

    def resize(self, workers: int) -> None:
        """Asks for ``workers`` Ray workers (at the next chunk request once running)."""
        self.workers = workers
        if self.source is not None:
            self.source.request_resize(workers)

    def close(self) -> None:
        if self.source is not None:
            self.pool_stats.keep(self.source)
            self.source.close()
            self.source = None

    def snapshot(self) -> dict[str, Any]:
        """Every owned stream's entry of the host state."""
        return {str(s): c.snapshot() for s, c in self.cursors.items()}

    def rows_in_hand(self) -> list[int]:
        """Rows of each stream's current chunk not taken yet."""
        return [c.rows - c.taken for c in self.cursors.values()]

    def _with_rows(self, s: int) -> StreamCursor | None:
        """Stream s's cursor, its next chunk started where the current one is used up; None
        where the stream ended."""
        c = self.cursors[s]
        if c.chunk is not None and c.taken == c.rows:
            if c.chunk.exhausted:
                return None
            c.finish()
        if c.chunk is None:
            c.start(self.source.next_chunk(s))
        return c

    def take(self, s: int, pieces: RowPieces, k: int) -> int:
        """Adds up to k rows of stream s to ``pieces``; returns rows added."""
        filled = 0
        while filled < k and (c := self._with_rows(s)) is not None:
            n = min(k - filled, c.rows - c.taken)
            tokens, layout, start = c.chunk.tokens, c.chunk.layout, c.taken
            if filled + n < k:
                # The chunk ends inside these rows, and the next one comes (its request sent)
                # before they are copied out: keep a copy of its last rows, not the chunk, so
                # that it leaves the object store now, as object_store_bytes_bound counts.
                tokens = tokens[:, start:start + n].copy()
                layout = layout[:, start:start + n].copy()
                start = 0
            pieces.add(tokens, layout, start, n)
            c.taken += n
            filled += n
        return filled

    def holds(self, s: int, n: int) -> bool:
        """Whether stream s's current chunk has ``n`` rows not taken yet; a chunk used up is
        first followed by the stream's next one, as ``take`` does."""
        c = self._with_rows(s)
        return c is not None and c.rows - c.taken >= n

    def add_ahead(self, s: int, pieces: RowPieces, k: int) -> None:
        """Adds stream s's next ``k`` rows for each of ``pieces.steps`` steps to ``pieces``,
        from its current chunk (``holds`` said it has them), without taking them: ``advance``
        takes them step by step."""
        c = self.cursors[s]
        pieces.add(c.chunk.tokens, c.chunk.layout, c.taken, k)

    def advance(self, streams: tuple[int, ...], k: int) -> None:
        """Takes ``k`` rows of each of ``streams``, added by ``add_ahead``."""
        for s in streams:
            self.cursors[s].taken += k

    def read_to_end(self) -> Iterator[tuple[int, int]]:
        """Reads every owned stream to its end, chunk by chunk: yields the real (rows, tokens)
        of each."""
        n = resolve_runtime(self.config).chunk_rows
        scratch = np.empty((len(FIELDS), n, self.config.seq_len), np.int32)
        groups = batch_groups(scratch)
        seg = FIELDS.index("inputs_segmentation")
        for s in self.streams:
            while True:
                pieces = RowPieces(self.config.seq_len)
                got = self.take(s, pieces, n)
                pieces.copy_into(groups)
                yield got, int(np.count_nonzero(scratch[seg, :got]))
                if got < n:
                    break
