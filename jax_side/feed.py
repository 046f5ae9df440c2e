"""HostFeed: takes k rows per owned stream per step, forms global arrays, prefetches.

One per JAX process. A background thread pulls chunks (from Ray workers or in-process
streams), copies each stream's k rows into its block of the local batch, pads streams that
ended with all-zero rows, and forms one ``jax.Array`` per field on the user's sharding with
``jax.make_array_from_process_local_data`` (one batched transfer when a single process holds
the whole batch). Up to ``device_prefetch`` finished batches wait in
a queue. Every batch carries the host state *after* it, so ``get_state`` describes exactly what
the consumer has received, never what was prefetched.

Batch ramp-up changes only how a stream's rows are batched, never the rows: step t (0-based)
takes k_t = B_t / S rows of every stream, so the host state (step, stream positions) resumes
exactly on either side of a ramp-up boundary::

    batch_rampup {0: 0.5, 2: 1.0}, B=8, S=4     step    0    1    2        3
                                                 k_t     1    1    2        2
    stream 0's rows  r0 r1 r2 r3 r4 r5 ...      takes   r0   r1   r2 r3    r4 r5
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import queue
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from ingest.config import Config, check_memory
from ingest.plan import UnitPlan, build_plan, deal_units
from ingest.shift import FIELDS
from ingest.stream import Chunk, open_stream
from ingest.tokenize import load_tokenizer
from jax_side.host_buffers import aligned_empty as _aligned_empty
from jax_side.host_state import HOST_STATE_VERSION, check_compatible
from jax_side.multihost import AGREEMENT_TIMEOUT_S, EndAgreement
from jax_side.private_api import put_arrays
from jax_side.sharding import host_rows, host_rows_per_batch_size

__all__ = ["HostFeed", "IteratorLength", "LocalSource", "steady_window_start", "steps_covering"]

log = logging.getLogger(__name__)

# A prior for iterator_length before any row is seen: English prose runs about 4 bytes per
# token with the GPT-2 and cl100k BPEs (measured on the demo corpus: 3.6-4.3).
BYTES_PER_TOKEN = 4.0
# Epochs whose deals are computed for iterator_length; later epochs repeat them (deals balance
# bytes, so every epoch's per-stream bytes are alike), and the count is then an estimate.
DEALT_EPOCHS = 8


def steady_window_start(steps: int) -> int | None:
    """The step that starts the steady window of a run of ``steps`` steps: the largest power
    of two at most ``steps / 2`` (None under 4 steps)."""
    if steps < 4:
        return None
    return 1 << ((steps // 2).bit_length() - 1)


def _device_put_fields(local: np.ndarray, sharding: NamedSharding) -> dict[str, jax.Array]:
    """The fields of ``local`` as arrays on ``sharding``, which covers all of them here."""
    return dict(zip(FIELDS, put_arrays(list(local), sharding), strict=True))


def global_arrays(local: np.ndarray, sharding: NamedSharding,
                  global_batch_size: int) -> dict[str, jax.Array]:
    """The six global ``[global_batch_size, seq_len]`` arrays from this process's rows
    (``local``: ``[6, rows, seq_len]``, from ``_aligned_empty``)."""
    if jax.process_count() == 1:
        # One process holds the whole batch: one batched transfer of the six fields, not six
        # make_array calls (0.29 ms on 1 device, 0.39 on 8).
        return _device_put_fields(local, sharding)
    shape = (global_batch_size, local.shape[2])
    return {name: jax.make_array_from_process_local_data(sharding, local[i], shape)
            for i, name in enumerate(FIELDS)}


@dataclasses.dataclass(frozen=True)
class IteratorLength:
    """How many global steps the feed delivers, counted from step 0 (resumed steps included;
    with ``reset_after_epoch``, one pass).

    Attributes:
      steps: the count; None when the data never ends (``num_epochs: null``).
      exact: whether ``steps`` is certain; False marks an estimate.
      basis: how it was found, in words.
    """

    steps: int | None
    exact: bool
    basis: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def steps_covering(config: Config, rows: int, *, start: int = 0, full: bool = False) -> int:
    """Steps from step ``start`` (0-based) on that ``rows`` rows of one stream reach, taking
    k_t = ``config.batch_size_at(t) / num_streams`` rows at step t: the steps holding at least
    one of them, or with ``full`` the steps they fill completely.

    ``steps_covering(c, 5)`` with k = 2 is 3 (rows 2, 2, 1); with ``full=True`` it is 2.
    """
    if rows <= 0:
        return 0
    keys = [t for t in (config.batch_rampup or {}) if t > start]
    n, t, left = 0, start, rows
    for end in [*keys, None]:
        k = config.batch_size_at(t) // config.num_streams
        span = None if end is None else end - t
        need = left // k if full else -(-left // k)
        if span is None or need < span or (not full and need == span):
            return n + need
        n, left, t = n + span, left - span * k, end
        if left <= 0:
            return n
    raise AssertionError("unreachable: the last ramp-up segment is endless")


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
    ``taken`` rows of the current chunk were used. ``documents``: the stream's documents
    counter after ``base`` and ``extra`` (None: ``base``'s own)."""

    base: dict[str, Any] | None = None
    extra: int = 0
    chunk: Chunk | None = None
    taken: int = 0
    documents: int | None = None

    def passed(self) -> int:
        """The stream's documents counter after the rows taken (states are saved at chunk
        ends; chunks count documents by row)."""
        if self.chunk is not None and self.taken and self.chunk.documents is not None:
            return int(self.chunk.documents[self.taken - 1])
        if self.documents is not None:
            return self.documents
        return int((self.base or {}).get("documents", 0))

    def snapshot(self) -> dict[str, Any]:
        if self.chunk is not None and self.taken == self.chunk.num_rows:
            return {"state": self.chunk.state_after, "taken": 0, "documents": self.passed()}
        return {"state": self.base, "taken": self.extra + self.taken, "documents": self.passed()}


@dataclasses.dataclass
class _Step:
    arrays: dict[str, jax.Array]
    state: dict[str, Any]
    tokens: int
    rows: int
    padding_rows: int
    padding_tokens: int


_END = object()
_POOL_STATS = ("restarts", "cpu_waits", "cpu_wait_s", "bytes_bound", "bytes_peak", "num_pending",
               "num_workers")
_POOL_RATES = ("rows_by_worker", "rows_by_stream")


class _Handoff:
    """The finished batches between the assembly thread and the consumer, at most ``size``.

    The consumer's side never wakes the other thread: ``queue.Queue.get`` (and a semaphore
    release) wakes a producer blocked on a full queue from inside the consumer's call, which
    took 15 us (median; 37 us mean) of every step here, about two thirds of the stall
    ``ingest bench`` measured. Here the consumer takes a ready batch from a deque (about
    1 us), and a producer that is ahead polls for room every millisecond.
    """

    _POLL_S = 0.001

    def __init__(self, size: int):
        self._size = max(1, size)
        self._items: collections.deque = collections.deque()
        self._ready = threading.Event()

    def put(self, item: Any, stop: threading.Event) -> bool:
        """Adds ``item`` once there is room; False if ``stop`` was set first."""
        while len(self._items) >= self._size:
            if stop.wait(self._POLL_S):
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
        if not self._items:
            self._ready.clear()
            # put_now appends before it sets: an item added since the check above is seen
            # here, or sets the event after the clear.
            if not self._items and not self._ready.wait(timeout_s):
                raise queue.Empty
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items


class HostFeed:
    """Iterates global batches: ``dict[field, jax.Array]`` of shape ``[B, seq_len]`` each.

    Args:
      config: the validated config.
      sharding: a ``NamedSharding`` for ``[global_batch_size, seq_len]`` arrays; rows may be
        split over one or several mesh axes, tokens over another.
      backend: ``ray`` (worker actors; Ray must be initialized) or ``local`` (in-process).
      workers: worker actors (default ``config.workers``); ignored by ``local``.
      plan: the unit plan (built from the config when None).
      device_prefetch: finished global batches kept ready. With 2, a consumer whose step
        took 1.25 x the feed's time per batch still waited 3-7 ms each time every stream
        needed a new chunk at once (16 chunk reads); with 4 it did not (benchmarks/).
      get_timeout_s: the longest one chunk may take (ray) before an error names it.
      agreement_timeout_s: with several JAX processes, the longest wait for the others at the
        end-of-data agreement before ``multihost.PeerError`` names those that never came.

    With several JAX processes, each builds one on the same global sharding and iterates it in
    step; at the end of finite data they agree on the last step (``jax_side.multihost``), and
    ``next`` raises ``multihost.PeerError`` if another process died meanwhile.

    With ``batch_rampup`` the arrays of step t have ``config.batch_size_at(t)`` rows, on the
    same sharding. With ``drop_remainder`` the feed ends before the first step with a padding
    row anywhere. With ``reset_after_epoch`` iterating it again restarts it (see ``__iter__``).
    ``dataset_size`` and ``iterator_length`` say how long an epoch and the run are.
    """

    def __init__(self, config: Config, *, sharding: NamedSharding, backend: str = "ray",
                 workers: int | None = None, plan: UnitPlan | None = None,
                 device_prefetch: int = 4, get_timeout_s: float = 300.0,
                 agreement_timeout_s: float = AGREEMENT_TIMEOUT_S):
        if backend not in ("ray", "local"):
            raise ValueError(f"backend={backend!r} must be 'ray' or 'local'")
        if not isinstance(sharding, NamedSharding):
            raise TypeError(f"sharding must be a jax.sharding.NamedSharding, got "
                            f"{type(sharding).__name__}")
        self.config = config
        self.sharding = sharding
        self.backend = backend
        # Before the row maps below, which are as large as the batch: each process's even share.
        check_memory(config, streams=max(1, config.num_streams // jax.process_count()),
                     host_batches=device_prefetch + 2)
        self._rows = host_rows(sharding, config.global_batch_size, config.seq_len,
                               config.num_streams)
        # Every batch size of the ramp-up, each checked against the sharding; same streams.
        self._rows_by_size = host_rows_per_batch_size(sharding, config.batch_sizes(),
                                                      config.seq_len, config.num_streams)
        # Several JAX processes and finite data: exhausted hosts pad until every host is, then
        # all stop after the same step (jax_side.multihost). _claim: the last step known to
        # have a row here (with drop_remainder: known to be full), written by the producer,
        # read by the consumer.
        self._multihost = jax.process_count() > 1 and config.num_epochs is not None
        self._agreement_timeout = agreement_timeout_s
        self._end = self._new_agreement()
        self._claim = 0
        self._partial_seen = False
        config.requests_in_flight(len(self._rows.streams))  # a budget too small fails here
        # Load the tokenizer here first, so a bad spec fails on the driver, not on a worker.
        load_tokenizer(config.tokenizer, config.tokenizer_backend)
        config.log_runtime_choices()
        self.plan = plan if plan is not None else build_plan(config)
        self._workers = workers if workers is not None else config.workers
        self._device_prefetch = device_prefetch
        self._timeout = get_timeout_s
        self._cursors = {s: _Cursor() for s in self._rows.streams}
        # Constant for the feed; computed once (per step it would be a sixth of the host's cost).
        self._fingerprints = (config.fingerprint(), config.output_fields())
        self._step = 0
        self._state = self._snapshot()
        self._source = None
        self._thread: threading.Thread | None = None
        self._queue = _Handoff(device_prefetch)
        self._stop = threading.Event()
        self._done = False
        self._pass_started = False  # a batch was delivered (or the end reached) this pass
        self._end_step: int | None = None  # the last step of a pass that ended
        self._dealt: dict[str, Any] | None = None  # per-epoch deals, for iterator_length
        self._closed_pool_stats: dict[str, Any] = {}
        # Every owned stream's entry once the data ended (rows read but not delivered
        # included): the counters stats() reports then.
        self._end_streams: dict[str, Any] | None = None
        # Consumer-side statistics (over every pass).
        self.steps = 0
        self.passes = 1  # passes begun: 1 + restarts (reset_after_epoch)
        self.tokens = 0
        self.padding_rows = 0
        self.padding_tokens = 0
        self.dropped_rows = 0
        self.dropped_tokens = 0
        self.wait_s = 0.0
        self.wait_max_s = 0.0
        self.wait_after_first_s = 0.0
        self.first_batch_time: float | None = None
        self.last_batch_time: float | None = None
        # (time, tokens, wait after the first batch) when ``steps`` reaches each power of two:
        # the steady rate is taken over the later part of the run from these.
        self._marks: dict[int, tuple[float, int, float]] = {}

    # -- state ---------------------------------------------------------------------------

    @property
    def streams(self) -> tuple[int, ...]:
        """The stream ids this host owns."""
        return self._rows.streams

    def _snapshot(self) -> dict[str, Any]:
        state = {
            "version": HOST_STATE_VERSION,
            "config_fingerprint": self._fingerprints[0],
            "config": self._fingerprints[1],
            "corpus_fingerprint": self.plan.fingerprint,
            "step": self._step,
            "streams": {str(s): c.snapshot() for s, c in self._cursors.items()},
        }
        if self.plan.content_fingerprint:
            # Without the files' locations: lets a moved corpus restore (check_compatible).
            state["corpus_content"] = self.plan.content_fingerprint
        return state

    def get_state(self) -> dict[str, Any]:
        """The state after the last batch the consumer received (small JSON)."""
        return self._state

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores before iterating. ``state`` may hold more streams than this host owns
        (a merged multi-host state); it must hold all of the owned ones.

        Raises:
          ValueError: incompatible config or corpus (naming what changed), missing streams.
        """
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
            self._cursors[s] = _Cursor(base=st["state"], extra=int(st["taken"]),
                                       documents=st.get("documents"))
        self._state = self._snapshot()
        self._pass_started = False

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
                c.documents = None
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
        size = cfg.batch_size_at(self._step)  # self._step: the 0-based index of this step
        k = size // cfg.num_streams
        rows = self._rows_by_size[size]
        local = _aligned_empty((len(FIELDS), rows.stop - rows.start, cfg.seq_len))
        got = padding_rows = 0
        for j, s in enumerate(rows.streams):
            n = self._take(s, local, j * k, k)
            if n < k:
                local[:, j * k + n:(j + 1) * k] = 0  # the stream ended: padding rows
            got += n
            padding_rows += k - n
        if got == 0 and self._end is None:
            return None
        self._step += 1
        if self._end is not None:
            if cfg.drop_remainder:
                # A step with padding here ends the claims: later steps are never full again.
                self._partial_seen = self._partial_seen or padding_rows > 0
                if not self._partial_seen:
                    self._claim = max(self._claim, self._step + self._steps_in_hand(full=True))
            elif got:
                self._claim = self._step + self._steps_in_hand()
        seg = local[FIELDS.index("inputs_segmentation")]
        tokens = int(np.count_nonzero(seg))
        arrays = global_arrays(local, self.sharding, size)
        return _Step(arrays, self._snapshot(), tokens, local.shape[1], padding_rows,
                     seg.size - tokens)

    def _steps_in_hand(self, *, full: bool = False) -> int:
        """Steps after the current one that rows already received reach for some stream (with
        ``full``: fill completely for every stream)."""
        left = [c.chunk.num_rows - c.taken if c.chunk is not None else 0
                for c in self._cursors.values()]
        if full:
            return min(steps_covering(self.config, n, start=self._step, full=True) for n in left)
        return max(steps_covering(self.config, n, start=self._step) for n in left)

    def _produce(self) -> None:
        try:
            if self._source is None:
                self._source = self._open_source()
            # One host with drop_remainder: the first step with padding is the last assembled
            # (the consumer drops it and counts its rows).
            last_partial = self.config.drop_remainder and self._end is None
            while not self._stop.is_set():
                step = self._assemble()
                items = [_END] if step is None else [step]
                if step is not None and last_partial and step.padding_rows:
                    items.append(_END)
                for item in items:
                    if not self._queue.put(item, self._stop):
                        return
                if items[-1] is _END:
                    return
        except BaseException as e:  # noqa: BLE001 -- re-raised on the consumer's thread
            self._queue.put_now(e)

    # -- consuming -----------------------------------------------------------------------

    def __iter__(self) -> HostFeed:
        """The feed itself. With ``reset_after_epoch``, once a batch was delivered (or the end
        reached) since the feed was built, restored or restarted, this restarts it from step 0:
        every ``for`` loop over a validation feed is one whole pass, the same batches each time.
        The consumer statistics keep counting over passes; ``passes`` counts the passes begun."""
        if self.config.reset_after_epoch and self._pass_started:
            self._restart()
        return self

    def _new_agreement(self) -> EndAgreement | None:
        if not self._multihost:
            return None
        return EndAgreement(drop_remainder=self.config.drop_remainder,
                            timeout_s=self._agreement_timeout)

    def _restart(self) -> None:
        """Stops the producer and the source, and goes back to step 0 (reset_after_epoch)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"reset_after_epoch: the producer thread did not stop within "
                                   f"get_timeout_s={self._timeout} s to restart the feed")
        self._cursors = {s: _Cursor() for s in self._rows.streams}
        self._end_streams = None
        if self._source is not None and hasattr(self._source, "reopen"):
            # Ray: the same workers start the pass again (no new actors per pass).
            self._source.reopen({s: (None, 0) for s in self._rows.streams})
        elif self._source is not None:
            self._keep_pool_stats()
            self._source.close()
            self._source = None
        self._thread = None
        self._stop = threading.Event()
        self._queue = _Handoff(self._device_prefetch)
        self._done = self._pass_started = self._partial_seen = False
        self._end_step = None
        self._step = self._claim = 0
        self._end = self._new_agreement()
        self._state = self._snapshot()
        self.passes += 1

    def _goes_ahead(self, item: _Step) -> bool:
        """Whether an assembled step is delivered (else the data ended before it)."""
        if self._end is not None:
            return self._end.continues(item.state["step"], self._claim)
        return not (self.config.drop_remainder and item.padding_rows)

    def __next__(self) -> dict[str, jax.Array]:
        if self._done:
            raise StopIteration
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce, name="HostFeed", daemon=True)
            self._thread.start()
        t0 = time.perf_counter()
        while True:
            try:
                item = self._queue.get(timeout_s=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the HostFeed producer thread died without a message; "
                                       "this is a bug in jax_side.feed") from None
        if isinstance(item, _Step) and not self._goes_ahead(item):
            # Rows only with drop_remainder: without it every host's rows ran out.
            self.dropped_rows += item.rows - item.padding_rows
            self.dropped_tokens += item.tokens
            item = _END
        now = time.perf_counter()
        waited = now - t0
        self.wait_s += waited
        self.wait_max_s = max(self.wait_max_s, waited)
        if item is _END:
            self._done = self._pass_started = True
            self._end_step = self._state["step"]
            self._finish()
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if self.first_batch_time is None:
            self.first_batch_time = now
        else:
            self.wait_after_first_s += waited
        self.last_batch_time = now
        self._pass_started = True
        self.steps += 1
        self.tokens += item.tokens
        if self.steps & (self.steps - 1) == 0:
            self._marks[self.steps] = (now, self.tokens, self.wait_after_first_s)
        self.padding_rows += item.padding_rows
        self.padding_tokens += item.padding_tokens
        self._state = item.state
        return item.arrays

    def _finish(self) -> None:
        """At the end of the data: stops the producer, counts every real row not delivered
        (``drop_remainder``: the rows of the first partial step, of the steps assembled after
        it, and the streams' rows after those, read to their end), and keeps every stream's
        final entry for ``stats``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._timeout)
            if self._thread.is_alive():
                log.warning("the HostFeed producer did not stop within get_timeout_s=%s s at "
                            "the end of the data: dropped rows and skip counters are those "
                            "of the delivered steps", self._timeout)
                return
        while not self._queue.empty():
            item = self._queue.get(timeout_s=0)
            if isinstance(item, _Step):
                self.dropped_rows += item.rows - item.padding_rows
                self.dropped_tokens += item.tokens
        if self.config.drop_remainder and self._source is not None:
            try:
                self._count_rest()
            except Exception as e:  # noqa: BLE001 -- the delivered batches stand; say so
                log.warning("drop_remainder: could not read the streams to their end to count "
                            "the rows not delivered (%s); dropped_rows and dropped_tokens are "
                            "a lower bound", e)
        self._end_streams = {str(s): c.snapshot() for s, c in self._cursors.items()}

    def _count_rest(self) -> None:
        """Reads every owned stream to its end, counting its real rows and tokens as dropped."""
        n = max(1, self.config.chunk_rows)
        scratch = np.empty((len(FIELDS), n, self.config.seq_len), np.int32)
        seg = FIELDS.index("inputs_segmentation")
        for s in self._rows.streams:
            while True:
                got = self._take(s, scratch, 0, n)
                self.dropped_rows += got
                self.dropped_tokens += int(np.count_nonzero(scratch[seg, :got]))
                if got < n:
                    break

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

    # -- how long ------------------------------------------------------------------------

    @property
    def dataset_size(self) -> int:
        """Documents per epoch: the rows of the unit plan, exact from the files' metadata
        (bad documents skipped while reading are counted in ``stats()``, not subtracted). For a
        materialized source, its packed rows."""
        return self.plan.total_rows

    @property
    def iterator_length(self) -> IteratorLength:
        """Global steps of the run (or of one pass with ``reset_after_epoch``), from step 0.

        Exact when it needs no tokenizing: endless data (None), a pass that has ended, or
        ``packing: none`` with ``long_documents: truncate`` (one row per document) and bad
        input as errors. Otherwise an estimate, from the unit plan's text bytes and the rows
        per byte the owned streams have produced so far (4 bytes per token before any row).
        Ramp-up and ``drop_remainder`` are taken into account.
        """
        c = self.config
        if c.num_epochs is None:
            return IteratorLength(None, True, "num_epochs is null: the data never ends")
        if self._done and self._end_step is not None:
            return IteratorLength(self._end_step, True, "this pass has ended")
        replay = getattr(self.plan, "stream_units", None)
        if replay is not None:
            # A materialized directory (ingest.replay): its manifest counts every stream's rows.
            num_rows = self.plan.units.num_rows
            rows = np.array([num_rows[list(units)].sum() for units in replay],
                            np.int64) * c.num_epochs
            exact, basis = True, "the materialized directory's rows, from its manifest"
        else:
            dealt = self._deals()
            exact_rows = (len(c.sources) == 1 and c.packing == "none"
                          and c.long_documents == "truncate" and c.on_bad_document == "error"
                          and c.on_bad_file == "error")
            if exact_rows:
                rows = dealt["docs"].sum(axis=0)
                basis = "packing none with long_documents truncate: one row per document"
                exact = dealt["exact"]
            else:
                rows, basis = self._estimated_rows(dealt)
                exact = False
            if not dealt["exact"]:
                basis += f"; epochs past {DEALT_EPOCHS} assumed like the first {DEALT_EPOCHS}"
        if c.drop_remainder:
            steps = min(steps_covering(c, int(r), full=True) for r in rows)
        else:
            steps = max(steps_covering(c, int(r)) for r in rows)
        return IteratorLength(steps, exact, basis if exact else "estimate: " + basis)

    def _deals(self) -> dict[str, Any]:
        """Each stream's units, bytes and documents per epoch (cached)."""
        if self._dealt is None:
            c = self.config
            epochs = min(c.num_epochs, DEALT_EPOCHS)
            nbytes, ndocs = self.plan.units.nbytes, self.plan.units.num_rows
            units = [deal_units(self.plan, num_streams=c.num_streams, seed=c.seed, epoch=e,
                                shuffle=c.shuffle, deal=c.deal) for e in range(epochs)]
            reps = [units[e % epochs] for e in range(c.num_epochs)]
            self._dealt = {
                "units": units,
                "bytes": np.array([[nbytes[u].sum() for u in per] for per in reps], np.float64),
                "docs": np.array([[ndocs[u].sum() for u in per] for per in reps], np.int64),
                "exact": epochs == c.num_epochs,
                "nbytes": nbytes, "ndocs": ndocs,
            }
        return self._dealt

    def _estimated_rows(self, dealt: dict[str, Any]) -> tuple[np.ndarray, str]:
        """Rows each stream gives in all: known for exhausted owned streams, else its bytes
        times the rows per byte seen on this host's streams."""
        c = self.config
        total_bytes = dealt["bytes"].sum(axis=0)
        known: dict[int, int] = {}
        seen_rows = seen_bytes = 0.0
        for sid, entry in self._state["streams"].items():
            st = entry["state"]
            if not st or len(c.sources) > 1 or not {"epoch", "unit", "doc"} <= set(st):
                continue  # nothing read yet, or a mixture's state (not one unit cursor)
            s = int(sid)
            if st.get("exhausted"):
                known[s] = int(st["rows_emitted"])
            e, u = int(st["epoch"]), int(st["unit"])
            units = dealt["units"][e % len(dealt["units"])][s]
            passed = dealt["bytes"][:e, s].sum() + dealt["nbytes"][units[:u]].sum()
            if u < len(units):
                uid = units[u]
                passed += dealt["nbytes"][uid] * min(1.0, int(st["doc"]) / dealt["ndocs"][uid])
            if st.get("exhausted"):
                passed = total_bytes[s]
            seen_rows += int(st["rows_emitted"])
            seen_bytes += float(passed)
        if seen_rows and seen_bytes:
            rate = seen_rows / seen_bytes
            basis = (f"plan text bytes x {rate * c.seq_len:.3f} tokens per byte seen in "
                     f"{int(seen_rows)} rows so far")
        else:
            rate = 1.0 / (BYTES_PER_TOKEN * c.seq_len)
            basis = f"plan text bytes at {BYTES_PER_TOKEN:g} bytes per token (no rows seen yet)"
        rows = np.array([known.get(s, math.ceil(total_bytes[s] * rate))
                         for s in range(c.num_streams)])
        return rows, basis

    def stats(self) -> dict[str, Any]:
        """Consumer-side statistics and the streams' counters (skips, truncations)."""
        span = ((self.last_batch_time or 0) - (self.first_batch_time or 0))
        skipped: dict[str, dict[str, int]] = {}
        skipped_units: dict[str, int] = {}
        documents = truncated_docs = truncated_tokens = 0
        mix_tokens = np.zeros(len(self.config.sources), np.int64)
        # Once the data ended, every row read counts (a run that skipped every document has
        # delivered no state to count from); before, the delivered state's counters (exact
        # on resume).
        entries = (self._end_streams if self._end_streams is not None
                   else self._state["streams"])
        for st in entries.values():
            s = st["state"] or {}
            if s.get("kind") == "mixture":
                mix_tokens += s["tokens"]
            documents += st.get("documents", s.get("documents", 0))
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
            "dropped_rows": self.dropped_rows,
            "dropped_tokens": self.dropped_tokens,
            "dataset_size": self.dataset_size,
            "iterator_length": self.iterator_length.to_json(),
            "passes": self.passes,
            "wait_s": self.wait_s,
            "wait_max_s": self.wait_max_s,
            "stall_fraction": (self.wait_after_first_s / span) if span > 0 else 0.0,
            "tokens_per_s": (self.tokens / span) if span > 0 else 0.0,
            **self._steady(),
            "workers": self._live_workers(),
            # Of those, workers not started yet: the cluster has no CPU for them (yet).
            "pending_workers": self._pool_stat("num_pending") if self.backend == "ray" else 0,
            "backend": self.backend,
            "restarts": self._pool_stat("restarts"),
            # Times every worker was lost and the streams waited for a CPU, and how long.
            "cpu_waits": self._pool_stat("cpu_waits"),
            "cpu_wait_s": self._pool_stat("cpu_wait_s"),
            "object_store_bytes_bound": self._pool_stat("bytes_bound"),
            "object_store_bytes_peak": self._pool_stat("bytes_peak"),
            "rows_per_s_by_worker": self._rates("rows_by_worker"),
            "rows_per_s_by_stream": self._rates("rows_by_stream"),
            "streams": len(self._rows.streams),
            "documents": documents,
            # A materialized source replays rows: its streams count no documents.
            "documents_counted": not hasattr(self.plan, "stream_units"),
            "skipped_documents": skipped,
            "skipped_rows_of_bad_files": skipped_units,
            "skipped_files": [p for p, _, _ in self.plan.skipped_files],
            "truncated_documents": truncated_docs,
            "truncated_tokens": truncated_tokens,
            # Realized mixture: tokens per source and their shares (several sources only).
            "tokens_by_source": mix_tokens.tolist() if len(mix_tokens) > 1 else [],
            "source_proportions": ([round(float(x), 4) for x in mix_tokens / mix_tokens.sum()]
                                   if len(mix_tokens) > 1 and mix_tokens.sum() else []),
        }

    def _live_workers(self) -> int:
        """Ray workers of the pool, started or pending (autoscale and ``resize`` change it);
        before the pool starts, the workers it will start (at most one per owned stream)."""
        if self.backend != "ray":
            return 0
        if self._source is None and "num_workers" not in self._closed_pool_stats:
            return min(self._workers, len(self._rows.streams))
        return int(self._pool_stat("num_workers")) + int(self._pool_stat("num_pending"))

    def _steady(self) -> dict[str, Any]:
        """Rate and stall over the later part of the run: from step ``m``, the largest power
        of two at most half the steps, to the last step. From the first batch on, the rows
        made before it (a chunk of every stream) count in the rate but not in the time;
        past ``m`` they are spent in runs much longer than a chunk's steps, so this is the
        rate a long training job sees."""
        m = steady_window_start(self.steps)
        if m is None or m not in self._marks or self.last_batch_time is None:
            return {"steady_from_step": None, "steady_tokens_per_s": 0.0,
                    "steady_stall_fraction": 0.0}
        t, tokens, waited = self._marks[m]
        span = self.last_batch_time - t
        return {"steady_from_step": m,
                "steady_tokens_per_s": (self.tokens - tokens) / span if span > 0 else 0.0,
                "steady_stall_fraction": ((self.wait_after_first_s - waited) / span
                                          if span > 0 else 0.0)}

    def close(self) -> None:
        """Stops the producer thread and the workers."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._source is not None:
            self._keep_pool_stats()
            self._source.close()
            self._source = None

    def _keep_pool_stats(self) -> None:
        self._closed_pool_stats = {k: self._pool_stat(k) for k in _POOL_STATS}
        self._closed_pool_stats.update({k: self._rates(k) for k in _POOL_RATES})

    def __enter__(self) -> HostFeed:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
