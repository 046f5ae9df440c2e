"""How long planning takes on a large Parquet corpus behind a slow object store.

Writes ``--files`` small Parquet files once (a few rows each, kept under ``--work`` so that
later runs reuse them), serves them through ``slowfs://``, an fsspec filesystem over the local
disk that waits ``--latency-ms`` on every request as an object store's round trip does (each
listing page of 1,000 keys, each info, each read; listings are flat, paged like S3's and
GCS's), and times ``ingest.plan.build.build_plan`` in fresh processes: a first plan with an empty
cache folder (cold), then a second one in a new process on the same corpus (warm). Prints a
table, with the requests each plan made by kind, and writes it as JSON with ``--out``.

Usage::

    python -m benchmarks.corpus_plan --files 10000 --latency-ms 20 --runs 2
    python -m benchmarks.corpus_plan --files 100000 --latency-ms 20 --out plan.json
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

__all__ = ["SlowFileSystem", "main", "register", "write_corpus"]

PROTOCOL = "slowfs"


class SlowFileSystem(AbstractFileSystem):
    """The local filesystem as an object store: ``slowfs:///abs/path`` is ``/abs/path``, and
    every request sleeps ``latency_s`` (a listing, one per page of ``page`` keys, in turn as
    continuation tokens make them). ``mtime = False`` makes a store whose listings give no
    modification time. ``requests`` counts the requests by kind, for the whole process."""

    protocol = PROTOCOL
    root_marker = "/"
    latency_s = 0.0
    page = 1000  # keys per listing page, as S3's and GCS's list calls return
    mtime = True
    requests: collections.Counter = collections.Counter()
    _count_lock = threading.Lock()

    @classmethod
    def _request(cls, kind: str, n: int = 1) -> None:
        with cls._count_lock:
            cls.requests[kind] += n
        if cls.latency_s:
            time.sleep(cls.latency_s * n)

    def _local(self, path: str) -> str:
        """The local path of ``slowfs:///abs/path`` (or of ``/abs/path``)."""
        path = path.removeprefix(f"{self.protocol}://")
        return path.rstrip("/") or "/"

    def _entry(self, path: str, st: os.stat_result, is_dir: bool) -> dict[str, Any]:
        out = {"name": path, "size": 0 if is_dir else st.st_size,
               "type": "directory" if is_dir else "file"}
        if self.mtime and not is_dir:
            out["mtime"] = st.st_mtime
        return out

    def info(self, path: str, **kwargs) -> dict[str, Any]:
        path = self._local(path)
        self._request("info")
        st = os.stat(path)  # FileNotFoundError as a store's 404
        return self._entry(path, st, os.path.isdir(path))

    def ls(self, path: str, detail: bool = True, **kwargs):
        path = self._local(path)
        names = sorted(os.listdir(path))
        self._request("list", max(1, math.ceil(len(names) / self.page)))
        out = [self._entry(p, os.stat(p), os.path.isdir(p))
               for p in (os.path.join(path, n) for n in names)]
        return out if detail else [e["name"] for e in out]

    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False,
             detail: bool = False, **kwargs):
        """A flat listing of every key below ``path``, paged (a store lists keys, not
        folders: ``withdirs`` adds the folders the keys imply, as s3fs does)."""
        path = self._local(path)
        out: dict[str, dict[str, Any]] = {}
        if os.path.isfile(path):
            self._request("list")
            out[path] = self._entry(path, os.stat(path), False)
        else:
            keys = 0
            for folder, dirs, names in os.walk(path):
                depth = 0 if folder == path else os.path.relpath(folder, path).count(os.sep) + 1
                if maxdepth is not None and depth >= maxdepth:
                    dirs[:] = []
                if withdirs and folder != path:
                    out[folder] = self._entry(folder, os.stat(folder), True)
                for n in names:
                    p = os.path.join(folder, n)
                    out[p] = self._entry(p, os.stat(p), False)
                    keys += 1
            self._request("list", max(1, math.ceil(keys / self.page)))
        out = dict(sorted(out.items()))
        return out if detail else list(out)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None,
                 **kwargs) -> bytes:
        """One ranged GET."""
        path = self._local(path)
        self._request("read")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            start = 0 if start is None else (start if start >= 0 else max(0, size + start))
            end = size if end is None else (end if end >= 0 else size + end)
            f.seek(start)
            return f.read(max(0, end - start))

    def _open(self, path: str, mode: str = "rb", block_size=None, autocommit=True,
              cache_options=None, **kwargs):
        if mode != "rb":
            raise NotImplementedError(f"{PROTOCOL}:// is read-only; mode={mode!r}")
        return _SlowFile(self, self._local(path), mode, block_size, autocommit,
                         cache_options=cache_options, **kwargs)


class _SlowFile(AbstractBufferedFile):
    """A file of ``SlowFileSystem``: opening asks for its size (one info request, as s3fs's
    HEAD) unless given, and each read of the buffer is one ranged GET."""

    def _fetch_range(self, start: int, end: int) -> bytes:
        return self.fs.cat_file(self.path, start, end)


def register() -> None:
    """Makes ``slowfs://`` known to fsspec (and so to ``ingest.sources.paths``) in this process."""
    import fsspec

    fsspec.register_implementation(PROTOCOL, SlowFileSystem, clobber=True)


def write_corpus(folder: str, files: int, rows: int = 4) -> None:
    """``files`` Parquet files of ``rows`` short documents each under ``folder``, 1,000 to a
    subfolder; written once (a marker file says the set is complete)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    done = os.path.join(folder, f"_complete-{files}-{rows}")
    if os.path.exists(done):
        return
    shutil.rmtree(folder, ignore_errors=True)
    t0 = time.perf_counter()
    for i in range(files):
        sub = os.path.join(folder, f"d{i // 1000:04d}")
        if i % 1000 == 0:
            os.makedirs(sub, exist_ok=True)
        texts = [f"document {r} of file {i}: the quick brown fox jumps over the lazy dog"
                 for r in range(rows)]
        path = os.path.join(sub, f"part-{i:06d}.parquet")
        pq.write_table(pa.table({"text": texts}), path)
        # Uploaded an hour ago, as a corpus is before it is trained on: the plan's cache
        # trusts a modification time only once it is older than the store clock's error.
        os.utime(path, (time.time() - 3600,) * 2)
    open(done, "w").close()
    print(f"wrote {files} files of {rows} rows under {folder} in "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)


def _child(args: argparse.Namespace) -> None:
    """One plan in this (fresh) process; prints its figures as one JSON line."""
    t0 = time.perf_counter()
    register()
    SlowFileSystem.latency_s = args.latency_ms / 1000
    from ingest.config import Config
    from ingest.plan.build import build_plan
    from ingest.source_config import SourceConfig

    config = Config(sources=(SourceConfig(paths=(f"{PROTOCOL}://{args.child}/",)),),
                    num_streams=8, unit_rows=256)
    imported = time.perf_counter() - t0
    t1 = time.perf_counter()
    plan = build_plan(config)
    seconds = time.perf_counter() - t1
    print(json.dumps({"seconds": seconds, "import_s": imported, "files": len(plan.files),
                      "units": len(plan.units), "fingerprint": plan.fingerprint,
                      "requests": dict(SlowFileSystem.requests)}))


def _plan_in_new_process(corpus: str, latency_ms: float, cache: str) -> dict[str, Any]:
    env = {**os.environ, "INGEST_CACHE_DIR": cache}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-m", "benchmarks.corpus_plan", "--child", corpus,
                          "--latency-ms", str(latency_ms)], env=env, capture_output=True,
                         text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"the planning process failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=10_000)
    p.add_argument("--rows", type=int, default=4, help="documents per file")
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--runs", type=int, default=1, help="cold + warm pairs")
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "ingest-corpus-plan"),
                   help="where the corpus is kept between runs")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args)
    corpus = os.path.join(args.work, f"corpus-{args.files}")
    write_corpus(corpus, args.files, args.rows)
    cache = os.path.join(args.work, "cache")
    rows = []
    for run in range(args.runs):
        shutil.rmtree(cache, ignore_errors=True)
        cold = _plan_in_new_process(corpus, args.latency_ms, cache)
        warm = _plan_in_new_process(corpus, args.latency_ms, cache)
        if cold["fingerprint"] != warm["fingerprint"]:
            raise RuntimeError(f"the warm plan differs: {cold} against {warm}")
        rows.append({"run": run, "cold": cold, "warm": warm})
        print(f"run {run}: cold {cold['seconds']:.1f} s, warm {warm['seconds']:.2f} s",
              file=sys.stderr)
    shutil.rmtree(cache, ignore_errors=True)
    print(f"{args.files} Parquet files of {args.rows} rows, {args.latency_ms:g} ms a request; "
          f"build_plan in a new process (imports not counted)")
    print(f"{'run':>3}  {'plan':>5}  {'seconds':>8}  requests")
    for r in rows:
        for kind in ("cold", "warm"):
            req = ", ".join(f"{k} {v}" for k, v in sorted(r[kind]["requests"].items()))
            print(f"{r['run']:>3}  {kind:>5}  {r[kind]['seconds']:>8.2f}  {req}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"files": args.files, "rows": args.rows, "latency_ms": args.latency_ms,
                       "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
