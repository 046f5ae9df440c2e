"""Steady-state throughput against ``chunk_rows``: how much a Ray call per chunk costs.

Runs ``ingest run`` over ``--epochs`` epochs of the demo corpus (or a config's sources) once
per chunk size, alternating sizes (in reverse order every other round) for ``--rounds`` rounds
so that a machine whose speed drifts hurts every size alike, and prints tokens/s (first to last
batch, and in the run's steady part), startup and the feed's object-store bound for each::

    python -m benchmarks.chunk_sweep [--config CONFIG] [--epochs 10] [--rows 128 256 512]

Many epochs make the rows produced before the first batch (``num_streams x chunk_rows`` of
them, and the requests in flight behind them) a small part of the run, which a one-epoch
measurement is not. Each call's result is one object in Ray's object store, and storing one
costs a worker three synchronous round trips to the raylet (create, seal, pin) and a copy,
whatever its size: larger chunks (or ``streams_per_call``) spread that over more tokens.
``benchmarks/actor_probe.py`` separates that part of the gain from the part per chunk of a
stream (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import yaml

from benchmarks.machine import ROOT, child_env

__all__ = ["main"]


def _config_file(config: str | None, epochs: int, rows: int, tmp: str) -> str:
    from ingest.config import load_config, to_dict
    from ingest.demo import demo_config

    cfg = load_config(config) if config else demo_config()
    path = os.path.join(tmp, f"sweep-{rows}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(cfg.replace(num_epochs=epochs, chunk_rows=rows)), f)
    return path


def _run(path: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "jax_side.run", "run", path, "--json",
                          "--no-progress", "--no-warm-start"], cwd=ROOT, env=child_env(),
                         capture_output=True, text=True, timeout=1800, check=False)
    if out.returncode != 0:
        raise SystemExit(f"ingest run {path} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _steady(summary: dict) -> str:
    """The run's steady rate, or why there is none (too few steps for a steady window)."""
    if not summary.get("steady_from_step"):
        return "no steady part (too few steps)"
    return (f"{summary['steady_tokens_per_s'] / 1e6:.2f} M steady "
            f"(from step {summary['steady_from_step']})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.chunk_sweep",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="YAML config (default: the built-in demo)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--rows", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    runs: dict[int, list[dict]] = {r: [] for r in args.rows}
    with tempfile.TemporaryDirectory(prefix="ingest-sweep-") as tmp:
        paths = {r: _config_file(args.config, args.epochs, r, tmp) for r in args.rows}
        for i in range(args.rounds):
            for r in args.rows if i % 2 == 0 else args.rows[::-1]:
                s = _run(paths[r])
                runs[r].append(s)
                print(f"round {i + 1}: chunk_rows {r}: {s['tokens_per_s'] / 1e6:.2f} M tokens/s "
                      f"from the first batch, {_steady(s)}, startup {s['startup_s']:.2f} s",
                      file=sys.stderr, flush=True)
    result = {}
    for r, ss in runs.items():
        result[r] = {"tokens_per_s": [s["tokens_per_s"] for s in ss],
                     "steady_tokens_per_s": [s["steady_tokens_per_s"] if s.get("steady_from_step")
                                             else None for s in ss],
                     "startup_s": [s["startup_s"] for s in ss],
                     "object_store_bytes_bound": ss[0].get("object_store_bytes_bound")}
        bound = result[r]["object_store_bytes_bound"]
        steady = [x for x in result[r]["steady_tokens_per_s"] if x]
        print(f"chunk_rows {r:5d}: {statistics.median(result[r]['tokens_per_s']) / 1e6:6.2f} M "
              f"tokens/s from the first batch"
              + (f", {statistics.median(steady) / 1e6:.2f} M steady" if steady else "")
              + f" (medians of {len(ss)}), startup "
              f"{statistics.median(result[r]['startup_s']):.2f} s, object-store bound "
              f"{bound / 2**20 if bound else 0:.0f} MiB", file=sys.stderr)
    print(json.dumps({"epochs": args.epochs, "runs": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
