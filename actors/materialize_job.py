"""``ingest materialize``: runs a finite config's streams to their end through the Ray worker
pool (or in-process) and writes their rows with ``ingest.materialize.writer``, with progress on
stderr (a bar on a terminal, else a log line every ``--log-every`` seconds) and a summary at
the end."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from typing import Any

import numpy as np

from actors.ray_cluster import start_ray
from ingest.cli import LOG_EVERY_S, config_from_args
from ingest.config import Config, check_memory
from ingest.materialize.writer import DEFAULT_SEGMENT_ROWS, MaterializeSummary, materialize
from ingest.plan.build import UnitPlan, build_plan
from ingest.plan.deal import deal_units
from ingest.stream.chunk_format import LAYOUT_FIELDS
from ingest.stream.kinds import Chunk
from ingest.tokenize.tokenizer import load_tokenizer

__all__ = ["materialize_command", "materialize_corpus"]

log = logging.getLogger("ingest.materialize.writer")


def materialize_corpus(config: Config, out: str, *, backend: str = "ray",
                       workers: int | None = None, plan: UnitPlan | None = None,
                       segment_rows: int = DEFAULT_SEGMENT_ROWS,
                       progress: Progress | None = None) -> MaterializeSummary:
    """Materializes ``config`` into ``out`` (continuing a job that stopped).

    Args:
      config: a validated config with finite ``num_epochs``.
      out: the directory.
      backend: ``ray`` (worker actors; Ray must be initialized) or ``local`` (in-process).
      workers: Ray worker actors (default ``config.runtime.workers``).
      plan: the unit plan (built from the config when None).
      segment_rows: rows per segment file.
      progress: reports progress (``Progress``), or None.
    """
    if backend not in ("ray", "local"):
        raise ValueError(f"backend={backend!r} must be 'ray' or 'local'")
    check_memory(config, host_batches=0)  # chunks that cannot fit fail here, not in a worker
    # Fail on the driver, before any worker starts, on a bad tokenizer spec (or a backend not
    # installed, or not proven on the vocabulary).
    load_tokenizer(config.tokenizer, config.runtime.tokenizer_backend)
    plan = plan if plan is not None else build_plan(config)

    def open_source(stream_ids: list[int]):
        if backend == "local":
            from ingest.stream.local_source import LocalSource  # noqa: PLC0415

            return LocalSource(config, plan, stream_ids)
        from actors.pool import WorkerPool  # noqa: PLC0415 (Ray only when asked for)

        return WorkerPool(config, plan, stream_ids, num_workers=workers if workers is not None
                          else config.runtime.workers)

    return materialize(config, plan, out, open_source, segment_rows=segment_rows,
                       progress=progress)


class Progress:
    """Rows, tokens and an ETA on stderr: a bar on a terminal, else an INFO log line every
    ``every_s`` seconds (default ``LOG_EVERY_S``).

    The ETA rests on units (slices of files) passed over all streams and epochs, so it is
    known before the rows are; it is left out where streams do not read units one by one
    (mixtures).
    """

    def __init__(self, config: Config, plan: UnitPlan, *, bar: bool | None = None,
                 every_s: float | None = None):
        self._config = config
        self._plan = plan
        self._per_stream = self._units_per_stream()
        self._total = (sum(sum(x) for x in self._per_stream)
                       if self._per_stream is not None else None)
        self._passed: dict[int, int] = {}
        self.rows = self.tokens = 0
        self._t0 = self._last_log = time.perf_counter()
        self._passed0 = 0
        self._use_bar = sys.stderr.isatty() if bar is None else bar
        self._every = LOG_EVERY_S if every_s is None else every_s
        self._bar = None

    def _units_per_stream(self) -> list[list[int]] | None:
        """Units each stream reads in each epoch (replay: segments per pass)."""
        c, plan = self._config, self._plan
        if c.sources[0].kind == "materialized":
            return [[len(u)] * (c.num_epochs or 1) for u in plan.stream_units]
        if len(c.sources) > 1 or c.num_epochs is None:
            return None
        per = [[] for _ in range(c.num_streams)]
        for e in range(c.num_epochs):
            for s, units in enumerate(deal_units(plan, num_streams=c.num_streams, seed=c.seed,
                                                 epoch=e, shuffle=c.shuffle, deal=c.deal)):
                per[s].append(len(units))
        return per

    def _units_passed(self, s: int, state: dict[str, Any] | None) -> int:
        per = self._per_stream[s]
        if state is None:
            return 0
        if state.get("exhausted"):
            return sum(per)
        if state.get("kind") == "replay":
            return sum(per[:state["epoch"]]) + state["segment"]
        return sum(per[:state["epoch"]]) + state["unit"]

    def start(self, positions: dict[int, dict[str, Any] | None], finished: list[int]) -> None:
        """Where the job starts: the unfinished streams' states, the finished streams."""
        for s in finished if self._per_stream is not None else ():
            self._passed[s] = sum(self._per_stream[s])
        for s, state in positions.items() if self._per_stream is not None else ():
            self._passed[s] = self._units_passed(s, state)
        self._passed0 = sum(self._passed.values())
        if self._use_bar:
            from tqdm import tqdm  # noqa: PLC0415

            # ``initial``: tqdm's rate, hence its ETA, counts only what this job does.
            self._bar = tqdm(total=self._total, initial=self._passed0, unit="unit",
                             desc="materialize", file=sys.stderr, dynamic_ncols=True)

    def update(self, s: int, chunk: Chunk) -> None:
        self.rows += chunk.num_rows
        seg = chunk.layout[LAYOUT_FIELDS.index("inputs_segmentation")]
        self.tokens += int(np.count_nonzero(seg))
        passed = None
        if self._per_stream is not None:
            self._passed[s] = self._units_passed(s, chunk.state_after)
            passed = sum(self._passed.values())
        if self._bar is not None:
            self._bar.set_postfix_str(f"rows {self.rows:,} tokens {self.tokens:,}", refresh=False)
            self._bar.update((passed - self._bar.n) if passed is not None else 0)
            return
        now = time.perf_counter()
        if now - self._last_log < self._every:
            return
        self._last_log = now
        span = now - self._t0
        line = (f"materialize: rows {self.rows:,}  tokens {self.tokens:,}  "
                f"{self.tokens / span:,.0f} tokens/s")
        if passed is not None and self._total:
            done = passed - self._passed0
            eta = (self._total - passed) * span / done if done > 0 else float("nan")
            line = (f"materialize: {100 * passed / self._total:.1f}% of units  "
                    + line.split(": ", 1)[1] + f"  ETA {eta:,.0f} s")
        log.info("%s", line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def summary_lines(s: MaterializeSummary) -> list[str]:
    return [
        f"materialize {s.out}: {'complete' if s.complete else 'INCOMPLETE'}  streams {s.streams} "
        f"(finished before {s.streams_done_before})  segments {s.segments} (written "
        f"{s.segments_written}, skipped {s.segments_skipped})",
        f"rows {s.rows:,} (written {s.rows_written:,})  tokens {s.tokens:,} (written "
        f"{s.tokens_written:,})  seconds {s.seconds:.1f}  "
        f"tokens/s {s.tokens_written / max(s.seconds, 1e-9):,.0f}",
    ]


def materialize_command(args) -> int:
    """``ingest materialize [CONFIG] --out DIR ...``."""
    cfg = config_from_args(args)
    check_memory(cfg, host_batches=0)  # before reading the corpus
    plan = build_plan(cfg)
    started_ray = False
    if args.backend == "ray":
        import ray  # noqa: PLC0415

        started_ray = not ray.is_initialized()
        # As `ingest run`: a local cluster gets at least one CPU per worker asked for.
        start_ray(args.address, max(os.cpu_count() or 1, cfg.runtime.workers))
    progress = None if args.no_progress else Progress(cfg, plan, every_s=args.log_every)
    try:
        summary = materialize_corpus(cfg, args.out, backend=args.backend, plan=plan,
                                     segment_rows=args.segment_rows, progress=progress)
    finally:
        if progress is not None:
            progress.close()
        if started_ray:
            import ray  # noqa: PLC0415

            # Before printing: Ray's log monitor writes to stdout asynchronously, and with
            # --json the summary must be the last line.
            ray.shutdown()
    for line in summary_lines(summary):
        print(line, file=sys.stderr)
    out = dataclasses.asdict(summary)
    if not summary.complete:
        out["error"] = (f"{args.out} is incomplete: not every stream reached its end; rerun "
                        f"the same command to continue it")
        out["exit_status"] = 1
        print(f"ingest: error: {out['error']}", file=sys.stderr)
    if args.json:
        print(json.dumps(out, sort_keys=True), flush=True)
    return 0 if summary.complete else 1
