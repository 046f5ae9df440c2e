"""What every stream produces, and the interface every stream has.

``Chunk``: consecutive rows of one stream with the stream's state after them. ``ChunkStream``:
the interface of the text stream (``ingest.stream.text.Stream``), the mixture
(``ingest.stream.mixture.MixedStream``) and the replay of a materialized corpus
(``ingest.materialize.replay.ReplayStream``), with the checks they share; ``state_from_json`` reads the
JSON state of any of them back. ``ChunkSource``: where a host's chunks come from (the Ray
worker pool, the in-process source, the warm start), with its counters ``SourceStats``.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Protocol, TypeVar

import numpy as np

from ingest.config import Config
from ingest.plan.units import UnitPlan
from ingest.stream.chunk_format import fields_of
from ingest.stream.state_check import StateRanges

__all__ = ["Chunk", "ChunkSource", "ChunkStream", "SourceStats", "StartAt", "state_from_json"]

State = TypeVar("State")


@dataclasses.dataclass
class Chunk:
    """Consecutive rows of one stream, with the stream's state after the last of them.

    The six fields of ``FIELDS`` are kept in two arrays (``TOKEN_FIELDS``,
    ``LAYOUT_FIELDS``); ``fields`` gives them as one int32 array, and
    ``ingest.stream.chunk_format.RowPieces`` copies rows of them into a batch's.

    Attributes:
      stream_id: the stream.
      tokens: int32 ``[2, num_rows, seq_len]``: inputs, targets.
      layout: ``[3, num_rows, seq_len]`` of ``layout_dtype(seq_len)``: inputs_position (also
        targets_position), inputs_segmentation, targets_segmentation.
      state_after: ``StreamState.to_json()`` after the last row.
      exhausted: the stream has no rows after these (fewer than asked may have come).
      documents: int64 ``[num_rows]``: the state's ``documents`` counter as it reads after
        each row (the state itself is saved at chunk ends only); None where not counted.
    """

    stream_id: int
    tokens: np.ndarray
    layout: np.ndarray
    state_after: dict[str, Any]
    exhausted: bool
    documents: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[1]

    @property
    def fields(self) -> np.ndarray:
        """The rows as int32 ``[6, num_rows, seq_len]``, fields in ``FIELDS`` order (a new
        array)."""
        return fields_of(self.tokens, self.layout)


# Where a stream starts: (its state, None for its beginning; rows to skip past that state).
StartAt = tuple[dict[str, Any] | None, int]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SourceStats:
    """A chunk source's counters at one moment.

    Attributes:
      num_workers: Ray workers running (0 in this process alone).
      num_pending: Ray workers started but waiting for a CPU.
      restarts: workers replaced after they died.
      resizes: changes of the worker count applied (on request or by autoscale).
      poisoned: documents located as killing workers and skipped.
      cpu_waits: times every worker was lost and the streams waited for a CPU.
      cpu_wait_s: the seconds of those waits.
      bytes_bound: the object-store bytes the host may hold at most.
      bytes_peak: the most it held (an upper bound).
      chunks_received: chunks handed out.
      requests: actor calls for chunks (one per chunk, or per group of streams).
      wait_s: seconds the caller waited for chunks.
      host_rows: rows made in this process while Ray started (the warm start).
      rows_by_worker: rows received, by worker name.
      rows_by_stream: rows received, by stream.
      started_at: ``time.perf_counter()`` when the source started.
      warming: this process still makes the chunks while the Ray workers start (the warm
        start, before its handoff).
    """

    num_workers: int = 0
    num_pending: int = 0
    restarts: int = 0
    resizes: int = 0
    poisoned: int = 0
    cpu_waits: int = 0
    cpu_wait_s: float = 0.0
    bytes_bound: int = 0
    bytes_peak: int = 0
    chunks_received: int = 0
    requests: int = 0
    wait_s: float = 0.0
    host_rows: int = 0
    rows_by_worker: dict[str, int] = dataclasses.field(default_factory=dict)
    rows_by_stream: dict[int, int] = dataclasses.field(default_factory=dict)
    started_at: float = 0.0
    warming: bool = False


class ChunkSource(Protocol):
    """Where the chunks of a host's streams come from: ``actors.pool.WorkerPool`` (Ray),
    ``ingest.stream.local_source.LocalSource`` (this process) and
    ``actors.warm_start.WarmStartSource`` (this process until Ray's pool runs)."""

    def open(self, states: dict[int, StartAt]) -> None:
        """Starts each stream at its saved state (None: its beginning), skipping the rows."""

    def next_chunk(self, s: int) -> Chunk:
        """The next chunk of stream ``s``, in order."""

    def reopen(self, states: dict[int, StartAt]) -> None:
        """Drops what was made ahead and starts the streams again at ``states`` (a pass
        restarted by ``reset_after_epoch``), keeping the workers."""

    def request_resize(self, n: int) -> None:
        """Asks for ``n`` workers, applied at a later ``next_chunk``; safe from any thread."""

    def stats(self) -> SourceStats:
        """The counters now."""

    def close(self) -> None:
        """Stops producing and releases the workers."""


class ChunkStream(abc.ABC):
    """Stream ``stream_id`` of ``config.num_streams`` over a plan: a deterministic, resumable
    source of rows.

    ``produce(n)`` gives the next rows as a ``Chunk``; ``get_state`` gives the position as
    small JSON and ``set_state`` restores it exactly; ``describe_head`` names the position in
    the corpus's terms, for error messages. Subclasses implement ``_produce`` (``produce``
    checks its argument first), the state pair, ``check_state`` and ``describe_head``.
    """

    def __init__(self, config: Config, plan: UnitPlan, stream_id: int):
        if not 0 <= stream_id < config.num_streams:
            raise ValueError(f"stream_id={stream_id} outside [0, num_streams={config.num_streams})")
        self.config = config
        self.plan = plan
        self.stream_id = stream_id

    def produce(self, n_rows: int) -> Chunk:
        """The next ``n_rows`` rows (fewer only when the data ends), as a chunk.

        Raises:
          ValueError: ``n_rows`` is not positive.
        """
        if n_rows <= 0:
            raise ValueError(f"n_rows={n_rows} must be positive")
        return self._produce(n_rows)

    def _produce(self, n_rows: int) -> Chunk:
        """``produce`` after its checks; ``n_rows`` is positive."""
        raise NotImplementedError(f"{type(self).__name__} implements neither produce nor "
                                  f"_produce")

    @abc.abstractmethod
    def get_state(self) -> dict[str, Any]:
        """The position after the last row produced, as JSON-ready values."""

    @abc.abstractmethod
    def set_state(self, state: dict[str, Any]) -> None:
        """Restores a position from ``get_state`` (of a stream of the same config)."""

    @abc.abstractmethod
    def describe_head(self) -> str:
        """Where the stream is, in the corpus's terms (for error messages)."""

    @classmethod
    @abc.abstractmethod
    def check_state(cls, state: Any, ranges: StateRanges, name: str, stream: int) -> None:
        """Checks a state saved by ``get_state`` of stream ``stream`` before it is restored:
        positions inside the plan's deal (``ranges``), counters counts.

        Raises:
          ingest.stream.state_check.StateInvalid: naming the field (under ``name``), its value and
            the allowed range.
        """


def state_from_json(cls: type[State], d: dict[str, Any], *, version: int, kind: str | None,
                    what: str, hint: str, derived: frozenset[str] = frozenset()) -> State:
    """The dataclass ``cls`` from a stream state saved as JSON.

    Args:
      cls: the state's dataclass.
      d: the saved state: ``cls``'s fields, ``version``, ``kind`` unless None, and the
        ``derived`` keys (written for readers, ignored here).
      version, kind: what ``d`` must say it is.
      what: the state's name in messages (``"stream"``, ``"mixture"``...).
      hint: why another kind or version may have come, for the message.

    Raises:
      ValueError: another kind or version, or keys ``cls`` does not know.
    """
    d = dict(d)
    saved_kind, saved_version = d.pop("kind", None), d.pop("version", None)
    if saved_kind != kind or saved_version != version:
        raise ValueError(f"not a {what} state of version {version} (kind {saved_kind!r}, "
                         f"version {saved_version!r}): {hint}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names - derived
    if unknown:
        raise ValueError(f"{what} state has unknown keys {sorted(unknown)}")
    return cls(**{k: v for k, v in d.items() if k in names})
