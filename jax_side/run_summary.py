"""The summary of ``ingest run``: its lines on stderr, the ``--json`` line, and the exit status
of a run that delivered nothing."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

__all__ = ["empty_run_message", "json_safe", "report", "summary_lines"]


def summary_lines(s: dict[str, Any]) -> list[str]:
    lines = [
        f"steps {s['steps']}  tokens {s['tokens']:,}  tokens/s {s['tokens_per_s']:,.0f}  "
        + (f"startup {s['startup_s']:.2f} s" if s.get("startup_s") is not None
           else "startup - (no batch)")
        + f"  stall {100 * s['stall_fraction']:.1f}%"
        + (f"  (from step {s['steady_from_step']}: tokens/s {s['steady_tokens_per_s']:,.0f}, "
           f"stall {100 * s['steady_stall_fraction']:.1f}%)" if s.get("steady_from_step") else "")
        + ("  (no --step-time: the loop only waits for batches)" if s.get("step_time_s") == 0
           else ""),
        f"backend {s['backend']}  workers {s['workers']}"
        + (f" ({s['pending_workers']} pending: no CPU for them)" if s.get("pending_workers")
           else "")
        + (f" (all {s['warm_start_rows']:,} rows made here: the data ended before Ray was up)"
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
    if "digest" in s:
        lines.append(f"digest {s['digest']}")
    return lines


def report(args, stats: dict[str, Any], start_step: int) -> int:
    """Prints the summary (the lead process, for every host) and returns the exit status:
    1 for a fresh run that delivered nothing, unless ``--allow-empty``."""
    import jax

    from jax_side import multihost

    if jax.process_count() > 1:
        stats = multihost.combine_stats(multihost.allgather_json(stats, "the run summaries"))
        if jax.process_index() != 0:
            return 0
    stats = json_safe(stats)
    stats["step_time_s"] = getattr(args, "step_time", None) or 0.0
    if not stats.get("documents_counted", True):
        stats["documents"] = None
    for line in summary_lines(stats):
        print(line, file=sys.stderr)
    if args.json:
        print(json.dumps(stats, sort_keys=True, allow_nan=False))
    if stats["steps"] == 0 and start_step == 0:
        # A fresh run that delivered nothing: every document skipped, say, or no rows at all.
        if not getattr(args, "allow_empty", False):
            print(f"ingest: error: {empty_run_message(stats)}", file=sys.stderr)
            return 1
        print(f"ingest: {empty_run_message(stats)} (allowed by --allow-empty)",
              file=sys.stderr)
    return 0


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
