"""Memory and first-batch time of ``ingest run`` on one large JSON Lines file.

Generates a JSONL file of the given size (documents cut from the Python standard library's
source, so no download), optionally zstd- or gzip-compressed, runs ``ingest run`` on it, and
samples the summed PSS (proportional set size: shared pages divided among the processes that
map them) of the ``ingest run`` process and all its descendants every 0.3 s. Prints one JSON
line per size: the peak PSS, the first-batch time the run reports, and the run's wall time.

Usage::

    python benchmarks/corpus_memory.py --gb 3 --steps 20 --backend local
    python benchmarks/corpus_memory.py --gb 1 2 4 8 --compress zstd --keep-data
    python benchmarks/corpus_memory.py --gb 2 --compress zstd --workers 2 --backend ray
    python benchmarks/corpus_memory.py --gb 3 --runs 2   # the second run reuses the scan

The generated files go under ``--dir`` (default: a temporary folder) and are deleted at the
end unless ``--keep-data``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import psutil
import pyarrow as pa


def _documents() -> list[str]:
    """Documents of a few KiB from the standard library's source."""
    docs = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(errors="replace")
        docs += [text[i:i + 4096] for i in range(0, len(text), 4096)]
    return docs


def write_jsonl(path: Path, nbytes: int, compress: str | None) -> int:
    """Writes about ``nbytes`` of JSONL (uncompressed) to ``path``; returns the lines."""
    lines = [(json.dumps({"id": i, "text": d}) + "\n").encode() for i, d in
             enumerate(_documents())]
    chunk = b"".join(lines)
    out = pa.CompressedOutputStream(str(path), compress) if compress else open(path, "wb")
    written = n = 0
    with out:
        while written < nbytes:
            out.write(chunk)
            written += len(chunk)
            n += len(lines)
    return n


def measure(config: Path, args: argparse.Namespace) -> dict:
    """Runs ``ingest run`` on ``config``; the peak summed PSS of its process tree."""
    ingest = Path(sys.executable).with_name("ingest")
    cmd = [str(ingest), "run", str(config), "--backend", args.backend, "--steps",
           str(args.steps), "--no-progress", "--json"]
    if args.workers:
        cmd += ["--workers", str(args.workers)]
    t0 = time.time()
    # A cache folder of its own, deleted with the data: no earlier run's decoded copies.
    env = {**os.environ, "INGEST_CACHE_DIR": str(config.parent / "cache")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    root = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        total = 0
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for p in procs:
            try:
                total += p.memory_full_info().pss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        peak = max(peak, total)
        time.sleep(0.3)
    out, err = proc.communicate(timeout=600)
    if proc.returncode:
        raise SystemExit(f"ingest run failed ({proc.returncode}):\n{err[-4000:]}")
    summary = json.loads(out.strip().splitlines()[-1])
    return {"peak_pss_gib": round(peak / 2**30, 3),
            "first_batch_s": round(summary.get("startup_s", float("nan")), 2),
            "wall_s": round(time.time() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, nargs="+", default=[3.0],
                    help="uncompressed sizes of the files to measure, in GiB")
    ap.add_argument("--compress", choices=["zstd", "gzip"], default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--backend", choices=["local", "ray"], default="local")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--dir", default=None, help="where to write the generated files")
    ap.add_argument("--keep-data", action="store_true")
    ap.add_argument("--runs", type=int, default=1,
                    help="runs per file (later runs find the first's cached scan)")
    args = ap.parse_args()
    folder = Path(args.dir or tempfile.mkdtemp(prefix="corpus_memory_"))
    folder.mkdir(parents=True, exist_ok=True)
    suffix = {"zstd": ".jsonl.zst", "gzip": ".jsonl.gz", None: ".jsonl"}[args.compress]
    try:
        for gb in args.gb:
            path = folder / f"corpus_{gb:g}gb{suffix}"
            t0 = time.time()
            lines = write_jsonl(path, int(gb * 2**30), args.compress)
            written = time.time() - t0
            config = folder / "config.yaml"
            config.write_text(f"sources:\n  - paths: [{json.dumps(str(path))}]\n"
                              f"    text_column: text\ntokenizer: gpt2\nseq_len: 1024\n"
                              f"global_batch_size: 32\n")
            for run in range(args.runs):
                result = measure(config, args)
                print(json.dumps({"gib": gb, "compress": args.compress, "lines": lines,
                                  "file_bytes": os.path.getsize(path), "run": run + 1,
                                  "write_s": round(written, 1), "backend": args.backend,
                                  **result}), flush=True)
            if not args.keep_data:
                path.unlink()
                shutil.rmtree(folder / "cache", ignore_errors=True)
    finally:
        if not args.keep_data and not args.dir:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
