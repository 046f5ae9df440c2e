"""Where a Ray worker's time goes during a real ``ingest run``: py-spy on every worker.

    python -m benchmarks.worker_profile [CONFIG] [--rate HZ] [--workers W] [--epochs E]
        [--steps S]

Runs ``ingest run`` on the config (default: the demo) as ``ingest bench`` does (one epoch, one
worker per CPU, unless the options say otherwise), attaches
``py-spy record --idle`` to each ``StreamWorker`` process as soon as it appears, and splits
each worker's main thread, from its first ``produce`` call to the end of its last, into: time
inside ``produce`` (tokenizer, Parquet read, shift, pack, the rest) and time outside it (Ray's
task loop: waiting for a request, serializing chunks). py-spy samples wall time, so a worker
the OS descheduled still counts where it stood: compare with the CPU seconds ``ingest bench``
reports. Needs ptrace rights (root, or ``kernel.yama.ptrace_scope=0``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import psutil

from benchmarks.corpus import make_spec
from benchmarks.machine import ROOT, child_env

__all__ = ["main", "split_worker_trace"]

# Frames of the produce path, as py-spy names them (Class.method or function). A frame inside
# another of its own part (a fast backend falling back to tiktoken) counts once.
PARTS = {
    "tokenize": ("TiktokenTokenizer.encode_docs", "FastBPETokenizer.encode_docs"),
    "tokenize_hf": ("HFTokenizer.encode_docs",),
    "parquet_read": ("read_texts",),
    "utf8_decode": ("decode_texts",),
    "shift": ("shift_rows",),
    "pack_shift": ("concat_fields",),
    "state": ("Stream.get_state",),
}


def split_worker_trace(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Seconds per part of one worker's main thread, from py-spy's chrometrace events."""
    tid = next((e["tid"] for e in events if e["name"] == "StreamWorker.produce"), None)
    if tid is None:
        raise ValueError("no StreamWorker.produce frame in the trace: the worker never produced")
    totals = dict.fromkeys([*PARTS, "produce", "serialize"], 0.0)
    names = {name: part for part, frames in PARTS.items() for name in frames}
    stack: list[tuple[str, float]] = []
    first = last = None
    for e in events:
        if e["tid"] != tid:
            continue
        if e["ph"] == "B":
            stack.append((e["name"], e["ts"]))
            continue
        if not stack:
            continue
        name, began = stack.pop()
        seconds = (e["ts"] - began) / 1e6
        if name in names:
            if not any(names.get(outer) == names[name] for outer, _ in stack):
                totals[names[name]] += seconds
        elif name == "StreamWorker.produce":
            totals["produce"] += seconds
            first = began if first is None else min(first, began)
            last = e["ts"] if last is None else max(last, e["ts"])
        elif "serializ" in name.lower() and not any("serializ" in n.lower() for n, _ in stack):
            totals["serialize"] += seconds
    window = (last - first) / 1e6
    inside = sum(totals[k] for k in PARTS)
    return {"window_s": window, "seconds": totals,
            "fractions_of_window": {
                **{k: totals[k] / window for k in PARTS if totals[k]},
                "produce_other": max(0.0, totals["produce"] - inside) / window,
                "outside_produce": max(0.0, window - totals["produce"]) / window,
                "serialize": totals["serialize"] / window}}


def _workers(pid: int) -> list[int]:
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    out = []
    for k in kids:
        try:
            if k.cmdline() and k.cmdline()[0].startswith("ray::StreamWorker"):
                out.append(k.pid)
        except psutil.Error:
            continue
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.worker_profile",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", help="YAML config (default: the built-in demo)")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--workers", type=int, help="Ray workers (default: one per CPU)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the corpus (default 1)")
    p.add_argument("--steps", type=int, help="stop after this many steps")
    args = p.parse_args(argv)
    spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
    if spy is None:
        raise SystemExit("py-spy not found next to this Python or on PATH: pip install py-spy")
    spec = make_spec(args.config, quick=False, steps=None)
    spec = dataclasses.replace(spec, config={**spec.config, "num_epochs": args.epochs})
    n_workers = args.workers or spec.cpus
    extra = ["--workers", str(n_workers)] + (["--steps", str(args.steps)] if args.steps else [])
    with tempfile.TemporaryDirectory(prefix="ingest-spy-") as tmp:
        run = subprocess.Popen(
            [sys.executable, "-m", "jax_side.run", "run",
             spec.write_run_config(os.path.join(tmp, "run.yaml")), "--json", "--no-progress",
             "--no-warm-start", *extra],
            cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        spies: dict[int, subprocess.Popen] = {}
        deadline = time.monotonic() + 120
        while run.poll() is None and len(spies) < n_workers and time.monotonic() < deadline:
            for w in _workers(run.pid):
                if w not in spies:
                    spies[w] = subprocess.Popen(
                        [spy, "record", "-p", str(w), "-r", str(args.rate), "--idle", "-t",
                         "-f", "chrometrace", "-o", os.path.join(tmp, f"{w}.json")],
                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            time.sleep(0.05)  # polling a process list: there is no event to wait on
        out, err = run.communicate(timeout=900)
        for s in spies.values():
            s.wait(timeout=60)  # py-spy stops when its process exits
        if run.returncode != 0:
            raise SystemExit(f"ingest run failed ({run.returncode}): {err[-2000:]}")
        summary = json.loads(out.strip().splitlines()[-1])
        workers = {}
        for w, s in spies.items():
            path = os.path.join(tmp, f"{w}.json")
            if not os.path.exists(path):
                raise SystemExit(f"py-spy wrote nothing for worker {w}: {s.stderr.read()[-500:]}")
            with open(path, encoding="utf-8") as f:
                workers[str(w)] = split_worker_trace(json.load(f))
    result = {"tokens_per_s": summary["tokens_per_s"], "startup_s": summary["startup_s"],
              "workers": workers}
    for w, r in workers.items():
        print(f"worker {w}: {r['window_s']:.2f} s from first to last produce; "
              + ", ".join(f"{k} {100 * v:.1f}%" for k, v in
                          sorted(r["fractions_of_window"].items(), key=lambda kv: -kv[1])),
              file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
