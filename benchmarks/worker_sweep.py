"""Tokens/s against Ray workers on one machine, each point long enough to measure.

``ingest bench`` runs its sweep over one epoch of the corpus, which on a machine of many CPUs
lasts under a second at the top of the sweep. This program sizes each point instead: at W
workers it runs ``ingest run --no-warm-start --workers W`` for as many steps as W cores of the
single-core tokenizer limit make in ``--seconds`` (over as many epochs as that takes), so that
every point measures about the same span of steady work. Beside each point it records where
the CPU went (the host process, the workers, Ray's own processes), each worker's rows/s, and,
as the machine's own ceiling, the tokenizer and our ``produce`` run on W cores at once (one
pinned process per core, no Ray) for as long as the run's work lasted: what the cores keep
up together when all of them are busy.

    python -m benchmarks.worker_sweep [CONFIG] [--workers 1 2 4 8 15] [--seconds 10]
        [--out benchmarks/results-sweep.json]

Prints a table to stderr and writes the figures as JSON (and a PNG beside it where matplotlib
is installed).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import yaml

from benchmarks import scaling
from benchmarks.corpus import make_spec
from benchmarks.machine import child_env, machine_facts, package_versions
from benchmarks.measure import busy_between, machine_steal_s, run_measured

__all__ = ["default_points", "main", "point_plan"]

TIMEOUT_S = 300.0  # one run of the sweep


def _log(msg: str) -> None:
    print(f"worker sweep: {msg}", file=sys.stderr, flush=True)


def default_points(cpus: int) -> list[int]:
    """1, 2, 4, ... below ``cpus - 1``, then ``cpus - 1``: one core stays for the host process."""
    top = max(1, cpus - 1)
    points, w = [], 1
    while w < top:
        points.append(w)
        w *= 2
    return [*points, top]


def point_plan(workers: int, seconds: float, limit: float, config: dict[str, Any],
               corpus_tokens: int | None) -> tuple[int, int]:
    """(steps, epochs) of a point: the steps ``workers`` cores at ``limit`` tokens/s make in
    ``seconds`` (at least 50), in the batches of ``config`` (its ``seq_len`` and
    ``global_batch_size``, overrides included), over enough epochs to last them."""
    tokens_per_step = config["seq_len"] * config["global_batch_size"]
    steps = max(50, math.ceil(seconds * workers * limit / tokens_per_step))
    epochs = (math.ceil(1.2 * steps * tokens_per_step / corpus_tokens) + 1
              if corpus_tokens else 1)
    return steps, max(1, epochs)


def _limits_on_cores(spec_path: str, cores: list[int], env: dict[str, str],
                     what: str = "tokenizer", seconds: float | None = None) -> list[dict]:
    """``benchmarks.limit WHAT`` on each of ``cores`` at once, one pinned process each; with
    ``seconds``, pass after pass for that long (``--seconds``)."""
    procs = []
    for core in cores:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "benchmarks.limit", what, "--spec", spec_path,
             *(["--seconds", f"{seconds:.1f}"] if seconds else [])],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            preexec_fn=lambda c=core: os.sched_setaffinity(0, {c})))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=TIMEOUT_S)
        if p.returncode != 0:
            raise RuntimeError(f"benchmarks.limit failed: {stderr[-2000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _run_point(workers: int, steps: int, config_path: str, env: dict[str, str]
               ) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "jax_side.run", "run", config_path, "--json", "--no-progress",
           "--no-warm-start", "--workers", str(workers), "--steps", str(steps)]
    r = run_measured(cmd, timeout_s=TIMEOUT_S, env=env)
    if not r.ok:
        return {"workers": workers, "steps": steps, "error": r.error()}
    s = r.summary
    out = {"workers": workers, "steps": s["steps"], "tokens": s["tokens"],
           **{k: s[k] for k in ("tokens_per_s", "steady_tokens_per_s", "startup_s",
                                "stall_fraction") if k in s}}
    by_worker = sorted((s.get("rows_per_s_by_worker") or {}).values())
    if by_worker:
        out["rows_per_s_per_worker"] = {"min": by_worker[0], "max": by_worker[-1],
                                        "mean": sum(by_worker) / len(by_worker)}
    out["wall_s"] = r.wall_s
    # The work after the first batch, in seconds.
    span = out["span_s"] = s["tokens"] / s["tokens_per_s"] if s.get("tokens_per_s") else 0.0
    m = r.memory or {}
    if "cpu_s" in m:
        wall = m["wall_s"]
        out["cpu_cores_busy"] = {k: round(v / wall, 3) for k, v in m["cpu_s"].items()}
        out["other_programs_cores_busy"] = round(m["other_programs_cpu_s"] / wall, 3)
        # CPU time the hypervisor gave to other machines while ours wanted it (steal).
        out["steal_cores"] = round(m.get("machine_steal_s", 0.0) / wall, 3)
        # The cores each process kept busy in the run's steady part (from a fifth into the
        # span after the first batch to its end): a worker near 1 bounds the rate, well below
        # 1 waits on something else.
        first = s.get("startup_s")
        if span and first and m.get("cpu_series"):
            out["steady_busy"] = busy_between(m["cpu_series"], first + 0.2 * span,
                                              first + span)
        out["workers_detail"] = m.get("workers_detail", [])[:workers]
    return out


def sweep(config: str | None, points: list[int], seconds: float, *,
          overrides: dict[str, Any] | None = None, limit: float | None = None,
          corpus_tokens: int | None = None,
          cores_limits: tuple[str, ...] = ("tokenizer", "produce")) -> dict[str, Any]:
    """Runs the sweep; ``overrides``: config fields set on every run; ``limit`` and
    ``corpus_tokens``: the single-core tokenizer rate and one epoch's tokens, measured here
    unless both are given; ``cores_limits``: the single-core measures (``benchmarks.limit``)
    also run on W cores at once at each point."""
    spec = make_spec(config, quick=False, steps=None)
    if overrides:
        spec = dataclasses.replace(spec, config={**spec.config, **overrides})
    env = child_env()
    results: dict[str, Any] = {
        "command": "python -m benchmarks.worker_sweep " + " ".join(sys.argv[1:]),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_facts(), "versions": package_versions(),
        "setting": {"config": config or "(built-in demo)", "tokenizer": spec.tokenizer,
                    "seq_len": spec.seq_len, "global_batch_size": spec.global_batch_size,
                    "num_streams": spec.num_streams, "seconds_per_point": seconds,
                    "overrides": overrides or {}},
    }
    with tempfile.TemporaryDirectory(prefix="ingest-sweep-") as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        spec.save(spec_path)
        if limit is None or corpus_tokens is None:
            _log("the tokenizer's single-core limit")
            one = _limits_on_cores(spec_path, [max(os.sched_getaffinity(0))], env)[0]
            limit = limit or one["tokens_per_s"]
            corpus_tokens = one["tokens"] if one["complete"] else None
        results["limit"] = {"tokens_per_s": limit, "corpus_tokens": corpus_tokens}
        runs = []
        for w in points:
            steps, epochs = point_plan(w, seconds, limit, spec.config, corpus_tokens)
            cfg = dict(spec.config, num_epochs=epochs)
            path = os.path.join(tmp, f"run-{w}.yaml")
            with open(path, "w", encoding="utf-8") as f:
                json.dump(cfg, f)
            _log(f"{w} worker(s): {steps} steps over {cfg['num_epochs']} epoch(s)")
            run = _run_point(w, steps, path, env)
            rate = run.get("steady_tokens_per_s") or run.get("tokens_per_s")
            if rate:
                run["of_w_x_limit"] = rate / (w * limit)
            cores = sorted(os.sched_getaffinity(0))[:w]
            # As long as the run's work after its first batch: a core's rate over a second
            # (the best of a few short passes) is above the rate it keeps up for longer.
            span = min(max(run.get("span_s") or seconds, 3.0), 4 * seconds)
            for what in cores_limits:
                _log(f"{w} worker(s): benchmarks.limit {what} on {len(cores)} core(s) at once "
                     f"for {span:.0f} s")
                steal0, t0 = machine_steal_s(), time.monotonic()
                together = _limits_on_cores(spec_path, cores, env, what, span)
                run[f"{what}_on_w_cores_steal_cores"] = round(
                    (machine_steal_s() - steal0) / (time.monotonic() - t0), 3)
                run[f"{what}_on_w_cores_tokens_per_s"] = sum(x["tokens_per_s"] for x in together)
                run[f"{what}_on_w_cores_passes"] = [x["passes_tokens_per_s"] for x in together]
            run["cores_limits_seconds"] = round(span, 1)
            runs.append(run)
            _log(json.dumps(run))
        results["runs"] = runs
    return results


def format_table(r: dict[str, Any]) -> str:
    lim = r["limit"]["tokens_per_s"]
    head = ("workers", "tok/s", "steady", "/ (W x limit)", "tokenizer on W cores",
            "produce on W cores", "host cores", "worker cores", "Ray cores", "steal cores")
    # host, worker and Ray cores: busy in the run's steady part where it was sampled, else
    # over the whole run (startup included)
    lines = [f"worker sweep on {r['machine']['cpus']} CPUs ({r['machine']['cpu_model']}); "
             f"single-core limit {lim / 1e6:.2f} M tokens/s",
             " | ".join(head)]
    for x in r["runs"]:
        if "error" in x:
            lines.append(f"{x['workers']} | error: {x['error'][:200]}")
            continue
        c = (x.get("steady_busy") or {}).get("cores") or x.get("cpu_cores_busy", {})
        tok, prod = (x.get(f"{w}_on_w_cores_tokens_per_s") for w in ("tokenizer", "produce"))
        lines.append(" | ".join([
            str(x["workers"]), f"{x['tokens_per_s'] / 1e6:.1f} M",
            f"{x.get('steady_tokens_per_s', 0) / 1e6:.1f} M", f"{x['of_w_x_limit']:.2f}",
            f"{tok / 1e6:.1f} M" if tok else "-", f"{prod / 1e6:.1f} M" if prod else "-",
            f"{c.get('host', 0):.2f}", f"{c.get('workers', 0):.2f}",
            f"{c.get('ray_system', 0) + c.get('ray_idle_workers', 0):.2f}",
            f"{x.get('steal_cores', 0):.2f}" + "".join(
                f", {w} alone {x[f'{w}_on_w_cores_steal_cores']:.2f}"
                for w in ("tokenizer", "produce") if f"{w}_on_w_cores_steal_cores" in x)]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.worker_sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="YAML config (default: the built-in demo)")
    p.add_argument("--workers", type=int, nargs="+",
                   help="worker counts (default: 1, 2, 4, ... and CPUs - 1)")
    p.add_argument("--seconds", type=float, default=10.0,
                   help="each point's steady work at W x the single-core limit (default 10)")
    p.add_argument("--out", default="benchmarks/results-sweep.json")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a config field for every run (YAML value), e.g. --set prefetch=4")
    p.add_argument("--limit", type=float,
                   help="the single-core tokenizer rate (tokens/s) to size the runs by "
                        "(default: measured first)")
    p.add_argument("--corpus-tokens", type=int,
                   help="one epoch's tokens (with --limit: no measurement first)")
    p.add_argument("--cores-limits", nargs="*", default=["tokenizer", "produce"],
                   choices=["tokenizer", "produce"],
                   help="single-core measures also run on W cores at once, one pinned process "
                        "each (default: both; none: skip)")
    args = p.parse_args(argv)
    points = args.workers or default_points(os.cpu_count() or 1)
    overrides = {}
    for item in args.set:
        field, sep, value = item.partition("=")
        if not sep:
            p.error(f"--set {item!r}: write FIELD=VALUE")
        overrides[field] = yaml.safe_load(value)
    r = sweep(args.config, points, args.seconds, overrides=overrides, limit=args.limit,
              corpus_tokens=args.corpus_tokens, cores_limits=tuple(args.cores_limits))
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(r, f, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    why = scaling.plot({"cpus": r["machine"]["cpus"], "runs": r["runs"],
                        "single_core_limit_tokens_per_s": r["limit"]["tokens_per_s"]}, png,
                       title=f"ingest run on {r['machine']['cpus']} CPUs, --no-warm-start")
    print(format_table(r), file=sys.stderr)
    _log(f"wrote {args.out}" + (f" ({why})" if why else f" and {png}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
