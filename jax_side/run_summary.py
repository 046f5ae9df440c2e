"""The summary of ``ingest run``: its lines on stderr, the ``--json`` line, and the exit status
of a run that delivered nothing.

Two rates, each named for what it means:

- the feed rate, how fast the feed can go: tokens per second over the later part of the run,
  from where the rows come from where they come for the rest of it (the Ray workers, once the
  warm start handed the streams over to them) and past the steady window's start (the rows
  made before the first batch count in a rate but took no time after it). It is measured only
  where the consumer does nothing but take batches: behind a training step, the step sets the
  pace.
- the run rate, what this run got: its tokens over the time from the process's start to the
  last batch, startup included.

A stall is reported only behind a (simulated) training step, ``ingest-dev run --step-time``:
the time the consumer waited over the time, from the warm start's handoff on; the startup
before the first batch is its own figure.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any

from jax_side.feed_stats import steady_window_start

__all__ = ["RunMeter", "empty_run_message", "json_safe", "print_json_error", "report",
           "summary_lines"]

# Fewer steps than this in the feed rate's window measure chunk boundaries, not a rate.
MIN_RATE_STEPS = 4


class RunMeter:
    """Measures the summary's rates and stall as batches arrive (see the module's docstring).

    Args:
      process_start: the wall-clock time (``time.time()``) the process started.
      start_step: the step the run starts after (a resumed run's).
    """

    def __init__(self, process_start: float, *, start_step: int = 0):
        self._start = process_start
        self._start_step = start_step
        self._first: float | None = None  # wall-clock time of the first and the last batch
        self._last: float | None = None
        # (feed steps, perf_counter time, tokens, waited after the first batch): at each power
        # of two of the steps, at the handoff, and at the last batch.
        self._marks: dict[int, tuple[int, float, int, float]] = {}
        self._handoff: tuple[int, float, int, float] | None = None
        self._end: tuple[int, float, int, float] | None = None

    def batch(self, counters: Any, workers_run: Callable[[], bool]) -> None:
        """Counts the batch just delivered; ``counters``: the ``HostFeed``'s;
        ``workers_run``: whether its rows come from where they come for the rest of the run
        (see the module), asked until it says so."""
        now = time.time()
        if self._first is None:
            self._first = now
        self._last = now
        n = counters.steps
        mark = (n, counters.last_batch_time, counters.tokens, counters.wait_after_first_s)
        if n & (n - 1) == 0:
            self._marks[n] = mark
        if self._handoff is None and workers_run():
            self._handoff = mark
        self._end = mark

    def stats(self, *, step_time_s: float) -> dict[str, Any]:
        """The summary's entries: ``startup_s``, ``run_s``, ``run_tokens_per_s``,
        ``feed_tokens_per_s`` (None where not measured, with ``feed_rate_unmeasured`` saying
        why), ``feed_rate_from_step``, ``handoff_step``, and with a training step
        ``training_stall_fraction``."""
        out: dict[str, Any] = {"startup_s": float("nan"), "run_s": None,
                               "run_tokens_per_s": None, "feed_tokens_per_s": None,
                               "feed_rate_from_step": None, "handoff_step": None}
        if self._end is None:
            out["feed_rate_unmeasured"] = "no batch"
            return out
        n, t_end, tokens, waited = self._end
        out["startup_s"] = self._first - self._start
        out["run_s"] = self._last - self._start
        out["run_tokens_per_s"] = tokens / out["run_s"] if out["run_s"] > 0 else None
        if self._handoff is not None:
            out["handoff_step"] = self._start_step + self._handoff[0]
        if step_time_s:
            since = self._handoff or self._marks[1]
            span = t_end - since[1]
            out["training_stall_fraction"] = ((waited - since[3]) / span if span > 0 else 0.0)
            out["training_stall_from_step"] = self._start_step + since[0]
            out["feed_rate_unmeasured"] = (f"a training step of {1e3 * step_time_s:g} ms sets "
                                           f"the pace, not the feed")
            return out
        if self._handoff is None:
            out["feed_rate_unmeasured"] = ("the run ended before the Ray workers took over: "
                                           "this process made every row")
            return out
        m = steady_window_start(n) or 1
        since = self._handoff if self._handoff[0] >= m else self._marks[m]
        if n - since[0] < MIN_RATE_STEPS or t_end <= since[1]:
            out["feed_rate_unmeasured"] = (f"only {n - since[0]} step(s) after step "
                                           f"{self._start_step + since[0]}: too few to measure; "
                                           f"a longer run measures it")
            return out
        out["feed_tokens_per_s"] = (tokens - since[2]) / (t_end - since[1])
        out["feed_rate_from_step"] = self._start_step + since[0]
        return out


def combine_rates(per_host: list[dict[str, Any]], combined: dict[str, Any]) -> dict[str, Any]:
    """``combined`` (``multihost.combine_stats``) with the ``RunMeter`` entries of every host:
    rates add up, times and the stall take the worst host."""
    out = dict(combined)
    for key in ("feed_tokens_per_s", "run_tokens_per_s"):
        values = [h.get(key) for h in per_host]
        out[key] = None if any(v is None for v in values) else sum(values)
    for key in ("run_s", "training_stall_fraction", "feed_rate_from_step", "handoff_step",
                "training_stall_from_step"):
        values = [h[key] for h in per_host if h.get(key) is not None]
        if values:
            out[key] = max(values)
    return out


def rate(x: float) -> str:
    """``12.3 M``, ``45.6 k``, ``789``: a rate for people."""
    if x >= 1e6:
        return f"{x / 1e6:,.1f} M"
    if x >= 1e4:
        return f"{x / 1e3:,.1f} k"
    return f"{x:,.0f}"


def duration(seconds: float) -> str:
    """``45 s``, ``12 min 5 s``, ``3 h 20 min``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def _rate_lines(s: dict[str, Any]) -> list[str]:
    """The summary's lines of rates and stall."""
    if not s.get("steps"):
        return []
    last = s.get("last_step", s["steps"])
    lines = []
    if s.get("feed_tokens_per_s"):
        by = ("the Ray workers making the rows" if s["backend"] == "ray"
              else "this process making the rows: --backend local")
        lines.append(f"feed rate {rate(s['feed_tokens_per_s'])} tokens/s: how fast the feed can "
                     f"go (steps {s['feed_rate_from_step']}-{last}, {by})")
    else:
        lines.append(f"feed rate - ({s.get('feed_rate_unmeasured', 'not measured')})")
    if s.get("run_tokens_per_s"):
        lines.append(f"run rate {rate(s['run_tokens_per_s'])} tokens/s: what this run got "
                     f"({s['tokens']:,} tokens in {s['run_s']:.2f} s from the process's start, "
                     f"startup included)")
    if s.get("training_stall_fraction") is not None:
        lines.append(f"stall {100 * s['training_stall_fraction']:.1f}% behind a simulated "
                     f"training step of {1e3 * s['step_time_s']:g} ms, from step "
                     f"{s['training_stall_from_step']} to {last}"
                     + (" (the Ray workers took over there)" if s.get("ray_up") and s.get(
                         "warm_start_rows") and s.get("handoff_step") else ""))
    return lines


def summary_lines(s: dict[str, Any]) -> list[str]:
    lines = [
        f"steps {s['steps']}  tokens {s['tokens']:,}  "
        + (f"startup {s['startup_s']:.2f} s (to the first batch)"
           if s.get("startup_s") is not None else "startup - (no batch)"),
        *_rate_lines(s),
        f"backend {s['backend']}  workers {s['workers']}"
        + (f" ({s['pending_workers']} pending: no CPU for them)" if s.get("pending_workers")
           else "")
        + (f" (all {s['warm_start_rows']:,} rows made here: the run ended before Ray was up)"
           if s.get("ray_up") is False else
           f" (the first {s['warm_start_rows']:,} rows made here while Ray started)"
           if s.get("warm_start_rows") else "") + f"  restarts {s['restarts']}  "
        + (f"(waited {s['cpu_wait_s']:.0f} s for a CPU {s['cpu_waits']} time(s))  "
           if s.get("cpu_waits") else "")
        + f"streams {s['streams']}  "
        f"padding rows {s['padding_rows']}  padding tokens {s['padding_tokens']:,}",
        (f"documents {s['documents']:,}" if s.get("documents") is not None
         else "documents - (a materialized source replays rows; it does not count documents)")
        + f"  truncated documents {s['truncated_documents']} "
        f"({s['truncated_tokens']:,} tokens)",
    ]
    if "dataset_size" in s:
        length = s["iterator_length"]
        steps = "endless" if length["steps"] is None else f"{length['steps']:,} steps"
        lines.append(f"dataset size {s['dataset_size']:,} documents per epoch  iterator length "
                     f"{steps} ({'exact: ' if length['exact'] else ''}{length['basis']})")
    if s.get("source_proportions"):
        lines.append("mixture: " + ", ".join(
            f"sources[{i}] {n:,} tokens ({100 * p:.1f}%)" for i, (n, p) in enumerate(
                zip(s["tokens_by_source"], s["source_proportions"], strict=True))))
    if s.get("dropped_rows"):
        lines.append(f"drop_remainder dropped {s['dropped_rows']} row(s) "
                     f"({s['dropped_tokens']:,} tokens): every row from the first partial step "
                     f"on")
    for reason, per_file in sorted(s["skipped_documents"].items()):
        total = sum(per_file.values())
        lines.append(f"skipped {total} document(s) as {reason}: "
                     + ", ".join(f"{p} ({n})" for p, n in sorted(per_file.items())))
    for path in s["skipped_files"]:
        lines.append(f"skipped unreadable file {path}")
    for path, n in sorted(s["skipped_rows_of_bad_files"].items()):
        lines.append(f"skipped {n} row(s) of unreadable data in {path}")
    if s.get("rows_per_s_by_worker"):
        lines.append("rows/s by worker: " + ", ".join(
            f"{w} {r:,.0f}" for w, r in sorted(s["rows_per_s_by_worker"].items())))
    if s.get("object_store_bytes_bound"):
        lines.append(f"object store held at most {s['object_store_bytes_peak'] / 2**20:.1f} MiB "
                     f"(bound {s['object_store_bytes_bound'] / 2**20:.1f} MiB)")
    if s.get("tokenizer"):
        t = s["tokenizer"]
        bos = ("none" if t["bos_id"] is None else t["bos_id"])
        lines.append(f"tokenizer {t['name']}: eos {t['eos_id']}, bos {bos} (bos: "
                     f"{json.dumps(t['bos'])}); {t['reason']}")
    if "digest" in s:
        lines.append(f"digest {s['digest']}")
    return lines


def report(args, stats: dict[str, Any], start_step: int) -> int:
    """Prints the summary (the lead process, for every host) and returns the exit status:
    1 for a fresh run that delivered nothing, unless ``--allow-empty``."""
    import jax

    from jax_side import multihost

    if jax.process_count() > 1:
        per_host = multihost.allgather_json(stats, "the run summaries")
        stats = combine_rates(per_host, multihost.combine_stats(per_host))
        if jax.process_index() != 0:
            return 0
    stats = json_safe(stats)
    stats["step_time_s"] = getattr(args, "step_time", None) or 0.0
    if not stats.get("documents_counted", True):
        stats["documents"] = None
    for line in summary_lines(stats):
        print(line, file=sys.stderr)
    status = 0
    if stats["steps"] == 0 and start_step == 0:
        # A fresh run that delivered nothing: every document skipped, say, or no rows at all.
        if not getattr(args, "allow_empty", False):
            print(f"ingest: error: {empty_run_message(stats)}", file=sys.stderr)
            stats["error"] = empty_run_message(stats)
            stats["exit_status"] = status = 1
        else:
            print(f"ingest: {empty_run_message(stats)} (allowed by --allow-empty)",
                  file=sys.stderr)
    if args.json:
        print(json.dumps(stats, sort_keys=True, allow_nan=False), flush=True)
    return status


def print_json_error(message: str, code: int) -> None:
    """The ``--json`` line of a run that failed: ``{"error": ..., "exit_status": ...}``."""
    print(json.dumps({"error": message, "exit_status": code}), flush=True)


def json_safe(x: Any) -> Any:
    """``x`` with every NaN or infinite float replaced by None (JSON has no NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    return x


def empty_run_message(s: dict[str, Any]) -> str:
    """Why a run delivered no batch, from its summary."""
    skipped = sum(n for per_file in s["skipped_documents"].values() for n in per_file.values())
    reasons = ", ".join(sorted(s["skipped_documents"]))
    causes = []
    if skipped:
        causes.append(f"{skipped} document(s) were skipped ({reasons}; on_bad_document: skip)")
    if s["skipped_rows_of_bad_files"]:
        causes.append(f"{sum(s['skipped_rows_of_bad_files'].values())} row(s) of unreadable "
                      f"data were skipped (on_bad_file: skip)")
    if s["skipped_files"]:
        causes.append(f"{len(s['skipped_files'])} unreadable file(s) were skipped")
    if s.get("dropped_rows"):
        causes.append(f"drop_remainder dropped {s['dropped_rows']} row(s): no step was full")
    why = "; ".join(causes) if causes else "the sources gave no rows"
    return (f"the run delivered no batch: {why}. Fix the sources (or on_bad_document / "
            f"on_bad_file / drop_remainder), or pass --allow-empty if an empty run is expected")
