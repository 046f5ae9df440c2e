"""Where the whole machine's CPU time goes while ``ingest run`` feeds: perf on every CPU.

    python -m benchmarks.machine_profile [CONFIG] [--epochs N] [--delay S] [--seconds S]
                                         [--symbols N]

Runs ``ingest run`` on the config (default: the demo) as ``ingest bench`` does, over
``--epochs`` epochs (default 6, so that the recording falls in the run's steady part), waits
``--delay`` seconds after the workers appear (startup and every stream's first chunk), then
samples every CPU with ``perf record -a`` for ``--seconds``. Each sample is put in one part:

    tokenizer         the workers in the tokenizer's library (tiktoken's, HF tokenizers', or
                      a faster exact backend's: tuetoken, riptoken, toktok, rs_bpe,
                      bpe_openai), and in libc's memcmp, which the BPE merges call for
                      every hash lookup (about a tenth of the bare tokenizer's own samples)
    worker_*          the workers' other time, by library: python, numpy, arrow (Arrow and
                      Parquet), libc (copies, malloc), kernel (page faults, system calls),
                      ray (Ray's core worker: storing chunks, its task loop), other
    host              the ``ingest run`` process (assembly, transfer, Ray's client threads)
    ray_system        Ray's own processes (raylet and object store, GCS, agents)
    other_programs    every other process on the machine
    idle              no process on the CPU

With ``--symbols N`` it also lists each part's N busiest functions (library and symbol).

The fractions are of all CPU time (CPUs x seconds): the ``tokenizer`` fraction bounds what
``ours / (CPUs x single-core limit)`` can be, if the tokenizer runs in a worker as fast as
alone. Needs Linux ``perf`` with rights to record every CPU (root, or
``kernel.perf_event_paranoid`` at most 0).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import psutil

from benchmarks.corpus import make_spec
from benchmarks.machine import ROOT, child_env
from benchmarks.measure import process_group

__all__ = ["classify", "main", "split_samples", "top_symbols"]

_LINE = re.compile(r"^\s*(\d+)\s+[0-9a-f]+\s+(.*?)\s*\((.*)\)\s*$")
# Each tokenizer library's shared object, by its package directory and file name.
_TOKENIZER_LIBS = ("tiktoken/_tiktoken", "tokenizers/tokenizers.", "riptoken/_riptoken",
                   "tuetoken/_core", "toktok/_toktok", "rs_bpe/bpe.", "bpe_openai/_bindings")
_WORKER_LIBS = (("python", ("libpython",)),
                ("numpy", ("_multiarray", "numpy", "bit_generator", "_generator")),
                ("arrow", ("libarrow", "libparquet", "pyarrow", "lib.cpython")),
                ("libc", ("libc.so", "libm.so", "ld-linux", "libstdc++")),
                ("kernel", ("[kernel",)),
                ("ray", ("_raylet",)))


def classify(role: str, dso: str, sym: str) -> str:
    """The part of one sample: ``role`` is worker, host, ray_system, other_programs or idle."""
    if role != "worker":
        return role
    base = os.path.basename(dso)
    if any(lib in dso for lib in _TOKENIZER_LIBS) or sym.startswith("__memcmp"):
        return "tokenizer"
    for part, libs in _WORKER_LIBS:
        if any(base.startswith(lib) or lib in base for lib in libs):
            return f"worker_{part}"
    return "worker_other"


def _samples(lines, roles: dict[int, str]):
    """(part, library, symbol) of each ``perf script -F pid,ip,sym,dso`` sample line."""
    for line in lines:
        m = _LINE.match(line)
        if m is None:
            continue
        pid = int(m.group(1))
        role = "idle" if pid == 0 else roles.get(pid, "other_programs")  # pid 0: an idle CPU
        yield classify(role, m.group(3), m.group(2)), m.group(3), m.group(2)


def split_samples(lines, roles: dict[int, str]) -> dict[str, int]:
    """Samples per part from ``perf script -F pid,ip,sym,dso`` lines; pid 0 is an idle CPU."""
    return dict(collections.Counter(part for part, _, _ in _samples(lines, roles)))


def top_symbols(lines, roles: dict[int, str], n: int) -> dict[str, list[tuple[str, int]]]:
    """Each part's ``n`` busiest ``library:symbol`` and their samples, from the same lines."""
    counts = collections.Counter((part, f"{os.path.basename(dso)}:{sym}")
                                 for part, dso, sym in _samples(lines, roles))
    out: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    for (part, sym), c in counts.most_common():
        if len(out[part]) < n:
            out[part].append((sym, c))
    return dict(out)


def _roles(run_pid: int, roles: dict[int, str]) -> None:
    """Adds the run's processes: the host, its workers, and Ray's other processes."""
    roles[run_pid] = "host"
    try:
        kids = psutil.Process(run_pid).children(recursive=True)
    except psutil.Error:
        return
    for k in kids:
        try:
            group = process_group(k.cmdline(), is_root=False)  # the memory sampler's groups
        except psutil.Error:
            continue
        if roles.get(k.pid) != "worker":  # a worker that exits shows another command line
            roles[k.pid] = "worker" if group == "workers" else "ray_system"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.machine_profile",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", help="YAML config (default: the built-in demo)")
    p.add_argument("--epochs", type=int, default=6, help="epochs for the run (default 6)")
    p.add_argument("--delay", type=float, default=3.0,
                   help="seconds after the workers appear before recording (default 3)")
    p.add_argument("--seconds", type=float, default=3.0, help="seconds to record (default 3)")
    p.add_argument("--frequency", type=int, default=999, help="samples per CPU per second")
    p.add_argument("--symbols", type=int, default=0, metavar="N",
                   help="also list each part's N busiest functions")
    args = p.parse_args(argv)
    perf = shutil.which("perf")
    if perf is None:
        raise SystemExit("perf not found on PATH: install linux-tools (perf) for this kernel")
    spec = make_spec(args.config, quick=False, steps=None)
    spec.config["num_epochs"] = args.epochs
    roles: dict[int, str] = {}
    with tempfile.TemporaryDirectory(prefix="ingest-perf-") as tmp:
        data = os.path.join(tmp, "perf.data")
        run = subprocess.Popen(
            [sys.executable, "-m", "jax_side.run", "run",
             spec.write_run_config(os.path.join(tmp, "run.yaml")), "--json", "--no-progress",
             "--no-warm-start"],
            cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        deadline = time.monotonic() + 120
        while run.poll() is None and time.monotonic() < deadline:
            _roles(run.pid, roles)
            if list(roles.values()).count("worker") >= spec.cpus:
                break
            time.sleep(0.05)  # polling a process list: there is no event to wait on
        time.sleep(args.delay)
        _roles(run.pid, roles)
        rec = subprocess.run([perf, "record", "-a", "-F", str(args.frequency), "-o", data,
                              "--", "sleep", str(args.seconds)],
                             capture_output=True, text=True)
        ended_early = run.poll() is not None
        _roles(run.pid, roles)
        out, err = run.communicate(timeout=900)
        if rec.returncode != 0:
            raise SystemExit(f"perf record failed ({rec.returncode}): {rec.stderr[-1500:]}; "
                             f"it needs rights to record every CPU (root, or "
                             f"kernel.perf_event_paranoid <= 0)")
        if run.returncode != 0:
            raise SystemExit(f"ingest run failed ({run.returncode}): {err[-2000:]}")
        script = subprocess.run([perf, "script", "-i", data, "-F", "pid,ip,sym,dso"],
                                capture_output=True, text=True, check=True)
    lines = script.stdout.splitlines()
    counts = split_samples(lines, roles)
    total = sum(counts.values())
    summary = json.loads(out.strip().splitlines()[-1])
    result: dict[str, Any] = {
        "tokens_per_s": summary["tokens_per_s"],
        "steady_tokens_per_s": summary.get("steady_tokens_per_s"),
        "cpus": psutil.cpu_count(), "seconds": args.seconds, "samples": total,
        "fractions": {k: round(v / total, 4) for k, v in
                      sorted(counts.items(), key=lambda kv: -kv[1])} if total else {},
        "recording_overlapped_the_end": ended_early}
    if args.symbols:
        result["symbols"] = {part: [[sym, round(c / total, 4)] for sym, c in top]
                             for part, top in top_symbols(lines, roles, args.symbols).items()}
        for part, top in result["symbols"].items():
            print(f"{part}: " + ", ".join(f"{sym} {100 * f:.1f}%" for sym, f in top),
                  file=sys.stderr)
    if ended_early:
        print("warning: the run ended while perf recorded; raise --epochs", file=sys.stderr)
    print(", ".join(f"{k} {100 * v:.1f}%" for k, v in result["fractions"].items()),
          file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
