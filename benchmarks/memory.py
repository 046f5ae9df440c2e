"""Memory over a long run: does any process grow from epoch to epoch?

Runs ``ingest run`` over ``--epochs`` epochs of the demo corpus (or a config's sources) on the
Ray backend, samples the RSS of the host and of every worker each ``--interval`` seconds, and
reports the peaks in each epoch's share of the run (by steps delivered, read off the progress
of the host's digest log), with the object store's bytes in use from the raylet::

    python -m benchmarks.memory [--config CONFIG] [--epochs 3] [--out memory.json]

A leak shows as later epochs peaking above the first; the chunk memory is bounded by the
config (``object_store_budget_mb`` or ``prefetch``), so the object store should stay flat.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import yaml

from benchmarks.measure import TreeSampler, kill_tree, own_bytes, process_group

# Peak bytes per epoch: RSS, and RSS less shared-memory pages (Ray's object store, mapped in).
_FIGURES = ("host", "host_own", "workers_max", "workers_sum", "workers_max_own")


def _config_file(config: str | None, epochs: int, tmp: str) -> str:
    from ingest.config import load_config, to_dict
    from ingest.demo import demo_config

    cfg = load_config(config) if config else demo_config()
    raw = to_dict(cfg.replace(num_epochs=epochs))
    path = os.path.join(tmp, "memory.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    return path


def _sample(root: psutil.Process) -> dict[str, int]:
    out = dict.fromkeys(_FIGURES, 0)
    try:
        tree = [(root, True)] + [(p, False) for p in root.children(recursive=True)]
    except psutil.Error:
        return out
    for proc, is_root in tree:
        try:
            rss = proc.memory_info().rss
            group = process_group(proc.cmdline(), is_root)
        except psutil.Error:
            continue
        if group == "host":
            out["host"] = rss
            mine = own_bytes(proc.pid)
            if mine is not None:
                out["host_own"] = mine
        elif group == "workers":
            out["workers_max"] = max(out["workers_max"], rss)
            mine = own_bytes(proc.pid)
            if mine is not None:
                out["workers_max_own"] = max(out["workers_max_own"], mine)
            out["workers_sum"] += rss
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", help="YAML config (default: the demo)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        config = _config_file(args.config, args.epochs, tmp)
        log = os.path.join(tmp, "digests.log")
        cmd = [sys.executable, "-m", "jax_side.run", "run", config, "--json", "--no-progress",
               "--digest-log", log, "--no-warm-start"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        root = psutil.Process(proc.pid)
        store = TreeSampler(proc.pid, interval_s=5.0, poll_object_store=True).start()
        series: list[dict[str, float]] = []
        stop = threading.Event()

        def loop():
            while not stop.wait(args.interval):
                s = _sample(root)
                try:
                    with open(log) as f:
                        s["step"] = sum(1 for _ in f)
                except OSError:
                    s["step"] = 0
                s["t"] = time.perf_counter()
                series.append(s)

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        try:
            out, err = proc.communicate(timeout=1800)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            raise
        finally:
            stop.set()
            t.join(timeout=5)
            store_figures = store.stop()
        if proc.returncode:
            print(err[-3000:], file=sys.stderr)
            return proc.returncode
    summary = json.loads(out.strip().splitlines()[-1])
    steps = summary["steps"]
    per_epoch = []
    for e in range(args.epochs):
        lo, hi = steps * e / args.epochs, steps * (e + 1) / args.epochs
        part = [s for s in series if lo < s["step"] <= hi] or [dict.fromkeys(_FIGURES, 0)]
        per_epoch.append({k: max(s[k] for s in part) / 2**20 for k in _FIGURES})
    result = {"epochs": args.epochs, "steps": steps, "tokens_per_s": summary["tokens_per_s"],
              "peak_mib_per_epoch": per_epoch,
              "object_store_used_peak_mib": (store_figures["object_store"]["used_peak_bytes"]
                                             or 0) / 2**20,
              "feed_object_store_bound_mib": summary.get("object_store_bytes_bound", 0) / 2**20,
              "cpu_s": {k: round(v, 1) for k, v in store_figures["cpu_s"].items()},
              "wall_s": round(store_figures["wall_s"], 1),
              "other_programs_cpu_s": round(store_figures["other_programs_cpu_s"], 1)}
    print(f"{args.epochs} epochs, {steps} steps, {summary['tokens_per_s'] / 1e6:.2f} M tokens/s")
    print("epoch  host MiB  host without shmem  largest worker MiB  all workers MiB  "
          "largest worker without shmem")
    for e, m in enumerate(per_epoch):
        print(f"{e:>5}  {m['host']:>8.0f}  {m['host_own']:>18.0f}  {m['workers_max']:>18.0f}  "
              f"{m['workers_sum']:>15.0f}  {m['workers_max_own']:>28.0f}")
    print(f"object store in use, peak: {result['object_store_used_peak_mib']:.1f} MiB "
          f"(the feed's bound: {result['feed_object_store_bound_mib']:.1f} MiB)")
    print(f"CPU seconds over {result['wall_s']} s: " + ", ".join(
        f"{k} {v}" for k, v in result["cpu_s"].items())
        + f", other programs {result['other_programs_cpu_s']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
