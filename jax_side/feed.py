"""HostFeed: takes k rows per owned stream per step, forms global arrays, prefetches.

One per JAX process. A background thread pulls chunks (from Ray workers or in-process
streams), copies each stream's k rows into its block of the local batch and pads streams that
ended with all-zero rows. Up to ``device_prefetch`` finished batches wait in a queue; the
consumer's ``next`` forms one ``jax.Array`` per field on the user's sharding, what
``jax.make_array_from_process_local_data`` makes (one batched transfer), on the thread that
runs the training step. Every batch carries the host state *after* it, so ``get_state``
describes exactly what the consumer has received, never what was prefetched.

The parts, each in its module: the streams' chunks and cursors (``chunk_intake``), a step's
rows and global arrays (``batch_assembly``), the thread and its handoff (``prefetch``), the
last step of finite data, agreed between hosts (``end_of_data``), the length of the run
(``iterator_length``) and the counters (``feed_stats``).

Batch ramp-up changes only how a stream's rows are batched, never the rows: step t (0-based)
takes k_t = B_t / S rows of every stream, so the host state (step, stream positions) resumes
exactly on either side of a ramp-up boundary::

    batch_rampup {0: 0.5, 2: 1.0}, B=8, S=4     step    0    1    2        3
                                                 k_t     1    1    2        2
    stream 0's rows  r0 r1 r2 r3 r4 r5 ...      takes   r0   r1   r2 r3    r4 r5
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding

from ingest.config import Config, check_memory
from ingest.plan.build import UnitPlan, build_plan
from ingest.runtime import resolve_runtime
from ingest.tokenize.tokenizer import load_tokenizer
from jax_side.batch_assembly import (
    AssembledStep,
    LocalBatch,
    assembled_step,
    fill_local_batch,
    fill_round,
    round_steps,
)
from jax_side.chunk_intake import ChunkIntake, LocalSource
from jax_side.end_of_data import EndOfData
from jax_side.feed_stats import FeedCounters, steady_window_start, stream_counters
from jax_side.host_state import StateHeader, check_restorable
from jax_side.iterator_length import IteratorLength, LengthEstimator, steps_covering
from jax_side.multihost import AGREEMENT_TIMEOUT_S
from jax_side.prefetch import END, Prefetcher
from jax_side.sharding import host_rows, host_rows_per_batch_size

__all__ = ["HostFeed", "IteratorLength", "LocalSource", "steady_window_start", "steps_covering"]

log = logging.getLogger(__name__)


class HostFeed:
    """Iterates global batches: ``dict[field, jax.Array]`` of shape ``[B, seq_len]`` each.

    Args:
      config: the validated config.
      sharding: a ``NamedSharding`` for ``[global_batch_size, seq_len]`` arrays; rows may be
        split over one or several mesh axes, tokens over another.
      backend: ``ray`` (worker actors; Ray must be initialized) or ``local`` (in-process).
      workers: worker actors (default ``config.runtime.workers``); ignored by ``local``.
      plan: the unit plan (built from the config when None).
      device_prefetch: finished global batches kept ready: enough to cover the step at which
        every stream needs a new chunk at once (benchmarks/RESULTS.md).
      get_timeout_s: the longest one chunk may take (ray) before an error names it.
      agreement_timeout_s: with several JAX processes, the longest wait for the others at the
        end-of-data agreement before ``multihost.PeerError`` names those that never came.
      await_ray: (ray) a call that returns once Ray is up, or raises what starting it raised
        (for a feed built while ``ray.init`` runs on another thread; ``lambda: None`` when Ray
        is up). Given, this process makes the first chunks itself until the workers run, then
        hands each stream to them where it is (``actors.warm_start``); the batches are the
        same.

    With several JAX processes, each builds one on the same global sharding and iterates it in
    step; at the end of finite data they agree on the last step (``jax_side.multihost``), and
    ``next`` raises ``multihost.PeerError`` if another process died meanwhile.

    With ``batch_rampup`` the arrays of step t have ``config.batch_size_at(t)`` rows, on the
    same sharding. With ``drop_remainder`` the feed ends before the first step with a padding
    row anywhere. With ``reset_after_epoch`` iterating it again restarts it (see ``__iter__``).
    ``dataset_size`` and ``iterator_length`` say how long an epoch and the run are; the
    consumer's counters (``steps``, ``tokens``, ``wait_s``, ...) are in ``counters``, a
    ``FeedCounters``.
    """

    def __init__(self, config: Config, *, sharding: NamedSharding, backend: str = "ray",
                 workers: int | None = None, plan: UnitPlan | None = None,
                 device_prefetch: int = 4, get_timeout_s: float = 300.0,
                 agreement_timeout_s: float = AGREEMENT_TIMEOUT_S,
                 await_ray: Callable[[], None] | None = None):
        if backend not in ("ray", "local"):
            raise ValueError(f"backend={backend!r} must be 'ray' or 'local'")
        if not isinstance(sharding, NamedSharding):
            raise TypeError(f"sharding must be a jax.sharding.NamedSharding, got "
                            f"{type(sharding).__name__}")
        self.counters = FeedCounters()
        self.config = config
        self.sharding = sharding
        self.backend = backend
        # Before the row maps below, which are as large as the batch: each process's even share
        # (batches assembled a round at a time: at most two rounds besides those prefetched).
        streams = max(1, config.num_streams // jax.process_count())
        most = max(config.batch_sizes()) * streams // config.num_streams
        check_memory(config, streams=streams, host_batches=device_prefetch + 2 * round_steps(
            most, config.seq_len, device_prefetch))
        self._rows = host_rows(sharding, config.global_batch_size, config.seq_len,
                               config.num_streams)
        # Every batch size of the ramp-up, each checked against the sharding; same streams.
        self._rows_by_size = host_rows_per_batch_size(sharding, config.batch_sizes(),
                                                      config.seq_len, config.num_streams)
        # Steps assembled at once, by batch size (batch_assembly.round_steps).
        self._round_by_size = {size: round_steps(r.stop - r.start, config.seq_len,
                                                 device_prefetch)
                               for size, r in self._rows_by_size.items()}
        # Several JAX processes and finite data: exhausted hosts pad until every host is, then
        # all stop after the same step (jax_side.end_of_data).
        self._agreement_timeout = agreement_timeout_s
        self._end = EndOfData(config, agreement_timeout_s)
        runtime = resolve_runtime(config)
        runtime.requests_in_flight(len(self._rows.streams))  # a budget too small fails here
        # Load the tokenizer here first, so a bad spec (a backend not installed or not proven
        # on the vocabulary) fails on the driver, not on a worker.
        load_tokenizer(config.tokenizer, config.runtime.tokenizer_backend)
        runtime.log_choices()
        self.plan = plan if plan is not None else build_plan(config)
        self._device_prefetch = device_prefetch
        self._timeout = get_timeout_s
        self._intake = ChunkIntake(config, self.plan, self._rows.streams, backend=backend,
                                   workers=workers if workers is not None
                                   else config.runtime.workers,
                                   get_timeout_s=get_timeout_s, await_ray=await_ray,
                                   step_rows=config.batch_size_at(0) // config.num_streams)
        self._header = StateHeader.of(config, self.plan)
        self._length = LengthEstimator(config, self.plan)
        self._step = 0
        self._state = self._snapshot()
        self._prefetch = Prefetcher(device_prefetch, self._next_items)
        self._done = False
        self._pass_started = False  # a batch was delivered (or the end reached) this pass
        self._end_step: int | None = None  # the last step of a pass that ended
        # Every owned stream's entry once the data ended (rows read but not delivered
        # included): the counters stats() reports then.
        self._end_streams: dict[str, Any] | None = None

    # -- state ---------------------------------------------------------------------------

    @property
    def streams(self) -> tuple[int, ...]:
        """The stream ids this host owns."""
        return self._rows.streams

    def _snapshot(self) -> dict[str, Any]:
        return self._header.state(self._step, self._intake.snapshot())

    def get_state(self) -> dict[str, Any]:
        """The state after the last batch the consumer received (small JSON)."""
        return self._state

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores before iterating. ``state`` may hold more streams than this host owns
        (a merged multi-host state); it must hold all of the owned ones.

        Raises:
          ValueError: incompatible config or corpus (naming what changed), missing streams.
        """
        if self._prefetch.started:
            raise RuntimeError("set_state must be called before iterating; make a new HostFeed")
        check_restorable(state, self.config, self.plan, self._rows.streams)
        self._step = int(state["step"])
        self._intake.restore(state["streams"])
        self._state = self._snapshot()
        self._pass_started = False

    # -- producing (background thread) ---------------------------------------------------

    def _assemble(self) -> AssembledStep | None:
        cfg = self.config
        size = cfg.batch_size_at(self._step)  # self._step: the 0-based index of this step
        local = fill_local_batch(self._intake, self._rows_by_size[size],
                                 size // cfg.num_streams, cfg.seq_len)
        if local.real_rows == 0 and not self._end.agreed:
            return None
        self._step += 1
        self._end.assembled(self._step, local.real_rows, local.padding_rows,
                            self._intake.rows_in_hand)
        return assembled_step(local, self.sharding, size, self._snapshot())

    def _assemble_round(self) -> list[AssembledStep] | None:
        """The next steps at once (``batch_assembly.fill_round``), where they have one batch
        size and every stream's chunk holds their rows; else None, nothing taken."""
        cfg = self.config
        size = cfg.batch_size_at(self._step)
        n = self._round_by_size[size]
        if n < 2 or any(cfg.batch_size_at(self._step + i) != size for i in range(1, n)):
            return None
        rows = self._rows_by_size[size]
        k = size // cfg.num_streams
        batches = fill_round(self._intake, rows, k, cfg.seq_len, n)
        if batches is None:
            return None
        steps = []
        for local in batches:
            self._intake.advance(rows.streams, k)
            self._step += 1
            self._end.assembled(self._step, local.shape[1], 0, self._intake.rows_in_hand)
            steps.append(assembled_step(LocalBatch(local, local.shape[1], 0), self.sharding,
                                        size, self._snapshot()))
        return steps

    def _next_items(self) -> list[Any]:
        """The producer thread's next items: one or more steps, then ``END`` once the data
        ended."""
        self._intake.open()
        steps = self._assemble_round()
        if steps:
            return steps
        step = self._assemble()
        if step is None:
            return [END]
        if step.padding_rows and self._end.ends_at_first_partial:
            return [step, END]
        return [step]

    # -- consuming -----------------------------------------------------------------------

    def __iter__(self) -> HostFeed:
        """The feed itself. With ``reset_after_epoch``, once a batch was delivered (or the end
        reached) since the feed was built, restored or restarted, this restarts it from step 0:
        every ``for`` loop over a validation feed is one whole pass, the same batches each time.
        The consumer statistics keep counting over passes; ``passes`` counts the passes begun."""
        if self.config.runtime.reset_after_epoch and self._pass_started:
            self._restart()
        return self

    def _restart(self) -> None:
        """Stops the producer and the source, and goes back to step 0 (reset_after_epoch)."""
        if not self._prefetch.stop(self._timeout):
            raise RuntimeError(f"reset_after_epoch: the producer thread did not stop within "
                               f"get_timeout_s={self._timeout} s to restart the feed")
        self._intake.rewind()
        self._end_streams = None
        self._prefetch = Prefetcher(self._device_prefetch, self._next_items)
        self._done = self._pass_started = False
        self._end_step = None
        self._step = 0
        self._end = EndOfData(self.config, self._agreement_timeout)
        self._state = self._snapshot()
        self.counters.passes += 1

    def __next__(self) -> dict[str, jax.Array]:
        return self._next_step().arrays()

    def _next_step(self) -> AssembledStep:
        """The next step, counted and its state delivered, before any global array is formed
        (``jax_side.host_local`` hands out its rows as they are)."""
        if self._done:
            raise StopIteration
        if not self._prefetch.started:
            self._prefetch.start()
        t0 = time.perf_counter()
        item = self._prefetch.get()
        if (isinstance(item, AssembledStep)
                and not self._end.goes_ahead(item.state["step"], item.padding_rows)):
            # Rows only with drop_remainder: without it every host's rows ran out.
            self.counters.count_dropped(item.rows - item.padding_rows, item.tokens)
            item = END
        now = time.perf_counter()
        waited = now - t0
        self.counters.count_wait(waited)
        if item is END:
            self._done = self._pass_started = True
            self._end_step = self._state["step"]
            self._finish()
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self.counters.count_batch(now, waited, item.tokens, item.padding_rows, item.padding_tokens)
        self._pass_started = True
        self._state = item.state
        return item

    def _finish(self) -> None:
        """At the end of the data: stops the producer, counts every real row not delivered
        (``drop_remainder``: the rows of the first partial step, of the steps assembled after
        it, and the streams' rows after those, read to their end), and keeps every stream's
        final entry for ``stats``."""
        if not self._prefetch.stop(self._timeout):
            log.warning("the HostFeed producer did not stop within get_timeout_s=%s s at "
                        "the end of the data: dropped rows and skip counters are those "
                        "of the delivered steps", self._timeout)
            return
        for item in self._prefetch.drain():
            if isinstance(item, AssembledStep):
                self.counters.count_dropped(item.rows - item.padding_rows, item.tokens)
        if self.config.drop_remainder and self._intake.source is not None:
            try:
                for rows, tokens in self._intake.read_to_end():
                    self.counters.count_dropped(rows, tokens)
            except Exception as e:  # noqa: BLE001 -- the delivered batches stand; say so
                log.warning("drop_remainder: could not read the streams to their end to count "
                            "the rows not delivered (%s); dropped_rows and dropped_tokens are "
                            "a lower bound", e)
        self._end_streams = self._intake.snapshot()

    def resize(self, workers: int) -> None:
        """Changes the number of Ray workers while iterating; streams move between workers
        without loss, and the batches do not change. Takes effect at the next chunk request."""
        if self.backend != "ray":
            raise ValueError("resize needs backend='ray'; the local backend has no workers")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers <= 0:
            raise ValueError(f"resize(workers={workers!r}): give a positive integer")
        self._intake.resize(workers)

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
        ended_at = self._end_step if self._done else None
        return self._length.length(self._state["streams"], ended_at=ended_at)

    def stats(self) -> dict[str, Any]:
        """Consumer-side statistics and the streams' counters (skips, truncations)."""
        # Once the data ended, every row read counts (a run that skipped every document has
        # delivered no state to count from); before, the delivered state's counters (exact
        # on resume).
        entries = (self._end_streams if self._end_streams is not None
                   else self._state["streams"])
        intake = self._intake
        return {
            **self.counters.volume_stats(),
            "dataset_size": self.dataset_size,
            "iterator_length": self.iterator_length.to_json(),
            "passes": self.counters.passes,
            **self.counters.timing_stats(),
            **intake.pool_stats.summary(intake.source, backend=self.backend,
                                        workers=intake.workers, streams=len(self._rows.streams)),
            "streams": len(self._rows.streams),
            **stream_counters(entries, self.plan, len(self.config.sources)),
        }

    @property
    def warming(self) -> bool:
        """Whether this process still makes the chunks while the Ray workers start (the warm
        start); False once they have taken the streams over, and without a warm start."""
        source = self._intake.source
        return source is not None and source.stats().warming

    def close(self) -> None:
        """Stops the producer thread and the workers."""
        self._prefetch.stop(10)
        self._intake.close()

    def __enter__(self) -> HostFeed:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
