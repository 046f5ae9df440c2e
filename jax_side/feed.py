"""HostFeed: takes k rows per owned stream per step, forms global arrays, prefetches.

One per JAX process. A background thread pulls chunks (from Ray workers or in-process
streams), copies each stream's k rows into its block of the local batch, pads streams that
ended with all-zero rows, and forms one ``jax.Array`` per field on the user's sharding with
``jax.make_array_from_process_local_data``. Up to ``device_prefetch`` finished batches wait in
a queue. Every batch carries the host state *after* it, so ``get_state`` describes exactly what
the consumer has received, never what was prefetched.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from ingest.config import Config
from ingest.plan import UnitPlan, build_plan
from ingest.shift import FIELDS
from ingest.stream import Chunk, open_stream
from ingest.tokenize import load_tokenizer
from jax_side.multihost import EndAgreement
from jax_side.sharding import host_rows

__all__ = ["HostFeed", "LocalSource"]

HOST_STATE_VERSION = 1


class LocalSource:
    """The ``local`` backend: the same streams, run in this process, without Ray."""

    def __init__(self, config: Config, plan: UnitPlan, stream_ids: list[int]):
        self._config = config
        self._streams = {s: open_stream(config, plan, s) for s in stream_ids}
        self.num_workers = 0
        self.wait_s = 0.0

    def open(self, states: dict[int, tuple[dict[str, Any] | None, int]]) -> None:
        for s, (st, skip) in states.items():
            if st is not None:
                self._streams[s].set_state(st)
            if skip:
                self._streams[s].produce(skip)

    def next_chunk(self, s: int) -> Chunk:
        t0 = time.perf_counter()
        c = self._streams[s].produce(self._config.chunk_rows)
        self.wait_s += time.perf_counter() - t0
        return c

    def close(self) -> None:
        self._streams.clear()


@dataclasses.dataclass
class _Cursor:
    """Where one stream is in the host's view: ``base`` is the state after the last chunk fully
    taken (None: the stream's beginning); ``extra`` rows past it were skipped on restore, and
    ``taken`` rows of the current chunk were used."""

    base: dict[str, Any] | None = None
    extra: int = 0
    chunk: Chunk | None = None
    taken: int = 0

    def snapshot(self) -> dict[str, Any]:
        if self.chunk is not None and self.taken == self.chunk.num_rows:
            return {"state": self.chunk.state_after, "taken": 0}
        return {"state": self.base, "taken": self.extra + self.taken}


@dataclasses.dataclass
class _Step:
    arrays: dict[str, jax.Array]
    state: dict[str, Any]
    tokens: int
    padding_rows: int
    padding_tokens: int


_END = object()
_POOL_STATS = ("restarts", "bytes_bound", "bytes_peak")
_POOL_RATES = ("rows_by_worker", "rows_by_stream")


class HostFeed:
    """Iterates global batches: ``dict[field, jax.Array]`` of shape ``[B, seq_len]`` each.

    Args:
      config: the validated config.
      sharding: a ``NamedSharding`` for ``[global_batch_size, seq_len]`` arrays; rows may be
        split over one or several mesh axes, tokens over another.
      backend: ``ray`` (worker actors; Ray must be initialized) or ``local`` (in-process).
      workers: worker actors (default ``config.workers``); ignored by ``local``.
      plan: the unit plan (built from the config when None).
      device_prefetch: finished global batches kept ready.
      get_timeout_s: the longest one chunk may take (ray) before an error names it.

    With several JAX processes, each builds one on the same global sharding and iterates it in
    step; at the end of finite data they agree on the last step (``jax_side.multihost``), and
    ``next`` raises ``multihost.PeerError`` if another process died meanwhile.
    """

    def __init__(self, config: Config, *, sharding: NamedSharding, backend: str = "ray",
                 workers: int | None = None, plan: UnitPlan | None = None,
                 device_prefetch: int = 2, get_timeout_s: float = 300.0):
        if backend not in ("ray", "local"):
            raise ValueError(f"backend={backend!r} must be 'ray' or 'local'")
        if not isinstance(sharding, NamedSharding):
            raise TypeError(f"sharding must be a jax.sharding.NamedSharding, got "
                            f"{type(sharding).__name__}")
        self.config = config
        self.sharding = sharding
        self.backend = backend
        self._rows = host_rows(sharding, config.global_batch_size, config.seq_len,
                               config.num_streams)
        # Several JAX processes and finite data: exhausted hosts pad until every host is, then
        # all stop after the same step (jax_side.multihost). _claim: the last step known to
        # have a row here, written by the producer, read by the consumer.
        self._end = (EndAgreement() if jax.process_count() > 1 and config.num_epochs is not None
                     else None)
        self._claim = 0
        config.requests_in_flight(len(self._rows.streams))  # a budget too small fails here
        # Load the tokenizer here first, so a bad spec fails on the driver, not on a worker.
        load_tokenizer(config.tokenizer)
        self.plan = plan if plan is not None else build_plan(config)
        self._workers = workers if workers is not None else config.workers
        self._device_prefetch = device_prefetch
        self._timeout = get_timeout_s
        self._cursors = {s: _Cursor() for s in self._rows.streams}
        # Constant for the feed; computed once (it was a sixth of the host's per-step cost).
        self._fingerprints = (config.fingerprint(), config.output_fields())
        self._step = 0
        self._state = self._snapshot()
        self._source = None
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, device_prefetch))
        self._stop = threading.Event()
        self._done = False
        self._closed_pool_stats: dict[str, Any] = {}
        # Consumer-side statistics.
        self.steps = 0
        self.tokens = 0
        self.padding_rows = 0
        self.padding_tokens = 0
        self.wait_s = 0.0
        self.wait_max_s = 0.0
        self.wait_after_first_s = 0.0
        self.first_batch_time: float | None = None
        self.last_batch_time: float | None = None

    # -- state ---------------------------------------------------------------------------

    @property
    def streams(self) -> tuple[int, ...]:
        """The stream ids this host owns."""
        return self._rows.streams

    def _snapshot(self) -> dict[str, Any]:
        return {
            "version": HOST_STATE_VERSION,
            "config_fingerprint": self._fingerprints[0],
            "config": self._fingerprints[1],
            "corpus_fingerprint": self.plan.fingerprint,
            "step": self._step,
            "streams": {str(s): c.snapshot() for s, c in self._cursors.items()},
        }

    def get_state(self) -> dict[str, Any]:
        """The state after the last batch the consumer received (small JSON)."""
        return self._state

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores before iterating. ``state`` may hold more streams than this host owns
        (a merged multi-host state); it must hold all of the owned ones.

        Raises:
          ValueError: incompatible config or corpus (naming what changed), missing streams.
        """
        from jax_side.checkpoint import check_compatible  # noqa: PLC0415 (cycle-free, lazy)

        if self._thread is not None:
            raise RuntimeError("set_state must be called before iterating; make a new HostFeed")
        check_compatible(state, self.config, self.plan)
        missing = [s for s in self._rows.streams if str(s) not in state["streams"]]
        if missing:
            raise ValueError(f"the state has no entry for stream(s) {missing}; it was saved "
                             f"with another num_streams or is incomplete")
        self._step = int(state["step"])
        for s in self._rows.streams:
            st = state["streams"][str(s)]
            self._cursors[s] = _Cursor(base=st["state"], extra=int(st["taken"]))
        self._state = self._snapshot()

    # -- producing (background thread) ---------------------------------------------------

    def _open_source(self):
        ids = list(self._rows.streams)
        if self.backend == "local":
            src = LocalSource(self.config, self.plan, ids)
        else:
            from actors.pool import WorkerPool  # noqa: PLC0415 (Ray only when asked for)

            src = WorkerPool(self.config, self.plan, ids, num_workers=self._workers,
                             get_timeout_s=self._timeout)
        src.open({s: (c.base, c.extra) for s, c in self._cursors.items()})
        return src

    def _take(self, s: int, out: np.ndarray, row0: int, k: int) -> int:
        """Copies up to k rows of stream s into ``out[:, row0:]``; returns rows copied."""
        c = self._cursors[s]
        filled = 0
        while filled < k:
            if c.chunk is not None and c.taken == c.chunk.num_rows:
                if c.chunk.exhausted:
                    break
                c.base, c.extra, c.chunk, c.taken = c.chunk.state_after, 0, None, 0
            if c.chunk is None:
                c.chunk = self._source.next_chunk(s)
                c.taken = 0
                continue
            n = min(k - filled, c.chunk.num_rows - c.taken)
            out[:, row0 + filled:row0 + filled + n] = c.chunk.fields[:, c.taken:c.taken + n]
            c.taken += n
            filled += n
        return filled

    def _assemble(self) -> _Step | None:
        cfg = self.config
        k = cfg.rows_per_stream
        local = np.zeros((len(FIELDS), self._rows.stop - self._rows.start, cfg.seq_len),
                         dtype=np.int32)
        got = padding_rows = 0
        for j, s in enumerate(self._rows.streams):
            n = self._take(s, local, j * k, k)
            got += n
            padding_rows += k - n
        if got == 0 and self._end is None:
            return None
        self._step += 1
        if got and self._end is not None:
            self._claim = self._step + self._steps_in_hand()
        seg = local[FIELDS.index("inputs_segmentation")]
        tokens = int(np.count_nonzero(seg))
        shape = (cfg.global_batch_size, cfg.seq_len)
        arrays = {name: jax.make_array_from_process_local_data(self.sharding, local[i], shape)
                  for i, name in enumerate(FIELDS)}
        return _Step(arrays, self._snapshot(), tokens, padding_rows, seg.size - tokens)

    def _steps_in_hand(self) -> int:
        """Steps after the current one that rows already received fill for some stream."""
        k = self.config.rows_per_stream
        left = [c.chunk.num_rows - c.taken for c in self._cursors.values() if c.chunk is not None]
        return -(-max(left, default=0) // k)

    def _produce(self) -> None:
        try:
            if self._source is None:
                self._source = self._open_source()
            while not self._stop.is_set():
                step = self._assemble()
                item = _END if step is None else step
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if step is None:
                    return
        except BaseException as e:  # noqa: BLE001 -- re-raised on the consumer's thread
            self._queue.put(e)

    # -- consuming -----------------------------------------------------------------------

    def __iter__(self) -> HostFeed:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        if self._done:
            raise StopIteration
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce, name="HostFeed", daemon=True)
            self._thread.start()
        t0 = time.perf_counter()
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the HostFeed producer thread died without a message; "
                                       "this is a bug in jax_side.feed") from None
        if self._end is not None and isinstance(item, _Step) and not self._end.continues(
                item.state["step"], self._claim):
            item = _END
        now = time.perf_counter()
        waited = now - t0
        self.wait_s += waited
        self.wait_max_s = max(self.wait_max_s, waited)
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if self.first_batch_time is None:
            self.first_batch_time = now
        else:
            self.wait_after_first_s += waited
        self.last_batch_time = now
        self.steps += 1
        self.tokens += item.tokens
        self.padding_rows += item.padding_rows
        self.padding_tokens += item.padding_tokens
        self._state = item.state
        return item.arrays

    def resize(self, workers: int) -> None:
        """Changes the number of Ray workers while iterating; streams move between workers
        without loss, and the batches do not change. Takes effect at the next chunk request."""
        if self.backend != "ray":
            raise ValueError("resize needs backend='ray'; the local backend has no workers")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers <= 0:
            raise ValueError(f"resize(workers={workers!r}): give a positive integer")
        self._workers = workers
        if self._source is not None:
            self._source.request_resize(workers)

    def _pool_stat(self, name: str) -> Any:
        if self._source is not None:
            return getattr(self._source, name, 0)
        return self._closed_pool_stats.get(name, 0)

    def _rates(self, name: str) -> dict[str, float]:
        """Rows per second since the pool started, keyed by worker or stream (ray backend)."""
        if self._source is None:
            return self._closed_pool_stats.get(name, {})
        counts = getattr(self._source, name, None)
        if not counts:
            return {}
        span = max(1e-9, time.perf_counter() - self._source.started_at)
        return {str(k): round(v / span, 1) for k, v in counts.items()}

    def stats(self) -> dict[str, Any]:
        """Consumer-side statistics and the streams' counters (skips, truncations)."""
        span = ((self.last_batch_time or 0) - (self.first_batch_time or 0))
        skipped: dict[str, dict[str, int]] = {}
        skipped_units: dict[str, int] = {}
        documents = truncated_docs = truncated_tokens = 0
        for st in self._state["streams"].values():
            s = st["state"] or {}
            documents += s.get("documents", 0)
            truncated_docs += s.get("truncated_documents", 0)
            truncated_tokens += s.get("truncated_tokens", 0)
            for reason, per_file in s.get("skipped", {}).items():
                for path, n in per_file.items():
                    skipped.setdefault(reason, {}).setdefault(path, 0)
                    skipped[reason][path] += n
            for path, n in s.get("skipped_units", {}).items():
                skipped_units[path] = skipped_units.get(path, 0) + n
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "padding_rows": self.padding_rows,
            "padding_tokens": self.padding_tokens,
            "wait_s": self.wait_s,
            "wait_max_s": self.wait_max_s,
            "stall_fraction": (self.wait_after_first_s / span) if span > 0 else 0.0,
            "tokens_per_s": (self.tokens / span) if span > 0 else 0.0,
            # The pool starts at most one worker per owned stream.
            "workers": min(self._workers, len(self._rows.streams)) if self.backend == "ray" else 0,
            "backend": self.backend,
            "restarts": self._pool_stat("restarts"),
            "object_store_bytes_bound": self._pool_stat("bytes_bound"),
            "object_store_bytes_peak": self._pool_stat("bytes_peak"),
            "rows_per_s_by_worker": self._rates("rows_by_worker"),
            "rows_per_s_by_stream": self._rates("rows_by_stream"),
            "streams": len(self._rows.streams),
            "documents": documents,
            "skipped_documents": skipped,
            "skipped_rows_of_bad_files": skipped_units,
            "skipped_files": [p for p, _, _ in self.plan.skipped_files],
            "truncated_documents": truncated_docs,
            "truncated_tokens": truncated_tokens,
        }

    def close(self) -> None:
        """Stops the producer thread and the workers."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._source is not None:
            self._closed_pool_stats = {k: self._pool_stat(k) for k in _POOL_STATS}
            self._closed_pool_stats.update({k: self._rates(k) for k in _POOL_RATES})
            self._source.close()
            self._source = None

    def __enter__(self) -> HostFeed:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
