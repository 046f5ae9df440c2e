"""Does ``produce`` slow down inside a Ray actor, or when its chunks go to the object store?

    python -m benchmarks.store_probe [--plain 0-7] [--ray 8-15] [--seconds 10] [--out F.json]

Starts one plain process per core of ``--plain`` and one Ray actor per core of ``--ray``, each
bound to its core, each with two streams of the demo config open, then runs phases in which
some of them loop ``Stream.produce`` (``chunk_rows`` rows a call) for ``--seconds`` from the
same moment: plain processes; actors that only produce ("ray"); actors that also ``ray.put``
each chunk, keeping the last two ("put"), as a worker's calls store theirs. Phases run each
kind alone on 8 cores, then half plain and half actors at once, then the first two again (the
machine's drift). For each kind it reports rows/s, rows per CPU-second, page faults and
involuntary context switches a second. Needs as many cores as ``--plain`` and ``--ray`` name.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import time
from typing import Any

__all__ = ["main"]

KINDS = ("plain", "ray", "put")


class Producer:
    """Two streams of the demo config, bound to ``core``, producing chunk after chunk."""

    def __init__(self, core: int, stream_ids: list[int]):
        from actors.worker import WORKER_ENV

        os.environ.update(WORKER_ENV)  # as a worker sets them, before the tokenizer loads
        os.sched_setaffinity(0, {core})
        from benchmarks.corpus import make_spec
        from ingest.config import Config
        from ingest.plan.build import build_plan
        from ingest.runtime import resolve_runtime
        from ingest.stream.kinds import open_stream
        from ingest.stream.process import one_cpu_producer
        from ingest.tokenize.tokenizer import load_tokenizer

        one_cpu_producer()
        spec = make_spec(None, quick=False, steps=None)
        self.cfg = Config.from_dict(dict(spec.config, num_epochs=100_000))  # never runs out
        plan = build_plan(self.cfg)
        tokenizer = load_tokenizer(self.cfg.tokenizer, self.cfg.runtime.tokenizer_backend)
        self.chunk_rows = resolve_runtime(self.cfg).chunk_rows
        self.core = core
        self.streams = [open_stream(self.cfg, plan, s, tokenizer) for s in stream_ids]
        for s in self.streams:  # warm: the first units read, the tokenizer loaded
            s.produce(self.chunk_rows)

    def ready(self) -> int:
        return self.core

    def run(self, t_start: float, t_end: float, put: bool) -> dict[str, Any]:
        ray = None
        if put:
            import ray
        keep = []
        while time.time() < t_start:
            time.sleep(0.002)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        c0, w0 = time.process_time(), time.time()
        rows = i = 0
        while time.time() < t_end:
            c = self.streams[i % len(self.streams)].produce(self.chunk_rows)
            i += 1
            rows += c.num_rows
            if put:
                keep.append(ray.put(c))
                if len(keep) > 2:
                    keep.pop(0)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        wall = time.time() - w0
        return {"core": self.core, "rows_per_s": rows / wall,
                "cpu": (time.process_time() - c0) / wall,
                "minflt_per_s": (r1.ru_minflt - r0.ru_minflt) / wall,
                "invcsw_per_s": (r1.ru_nivcsw - r0.ru_nivcsw) / wall}


def _plain_main(conn, core: int, stream_ids: list[int]) -> None:
    p = Producer(core, stream_ids)
    conn.send(p.ready())
    while (msg := conn.recv()) is not None:
        conn.send(p.run(*msg))


def _cores(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for kind in KINDS:
        xs = [r for r in runs if r["kind"] == kind]
        if xs:
            n = len(xs)
            out[kind] = {"rows_per_s_each": round(sum(r["rows_per_s"] for r in xs) / n),
                         "cores_busy_each": round(sum(r["cpu"] for r in xs) / n, 3),
                         "rows_per_cpu_s": round(sum(r["rows_per_s"] for r in xs)
                                                 / sum(r["cpu"] for r in xs)),
                         "faults_per_s_each": round(sum(r["minflt_per_s"] for r in xs) / n),
                         "involuntary_switches_per_s_each":
                             round(sum(r["invcsw_per_s"] for r in xs) / n, 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.store_probe",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--plain", default="0-7", help="cores of the plain processes")
    p.add_argument("--ray", default="8-15", help="cores of the Ray actors")
    p.add_argument("--seconds", type=float, default=10.0, help="each phase's length")
    p.add_argument("--out", help="write the phases as JSON here")
    args = p.parse_args(argv)
    plain_cores, ray_cores = _cores(args.plain), _cores(args.ray)
    if max(len(plain_cores), len(ray_cores)) > 8:
        p.error("at most 8 cores each: the producers of a kind hold two of the demo's 16 "
                "streams each")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
    ctx = mp.get_context("spawn")
    plain = {}
    for k, c in enumerate(plain_cores):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_plain_main, args=(there, c, [k, k + 8]), daemon=True)
        proc.start()
        plain[c] = here
    import ray

    ray.init(num_cpus=len(ray_cores) + 1, include_dashboard=False)
    try:
        actor = ray.remote(num_cpus=1)(Producer)
        actors = {c: actor.remote(c, [k, k + 8]) for k, c in enumerate(ray_cores)}
        for c, conn in plain.items():
            if not conn.poll(300):
                raise TimeoutError(f"the plain process on core {c} did not start in 300 s")
            conn.recv()
        ray.get([a.ready.remote() for a in actors.values()], timeout=300)
        hp = plain_cores[:max(1, len(plain_cores) // 2)]
        hr = ray_cores[:max(1, len(ray_cores) // 2)]
        phases = [("plain", dict.fromkeys(plain_cores, "plain")),
                  ("ray", dict.fromkeys(ray_cores, "ray")),
                  ("put", dict.fromkeys(ray_cores, "put")),
                  ("half plain, half ray", {**dict.fromkeys(hp, "plain"),
                                            **dict.fromkeys(hr, "ray")}),
                  ("half plain, half put", {**dict.fromkeys(hp, "plain"),
                                            **dict.fromkeys(hr, "put")}),
                  ("plain again", dict.fromkeys(plain_cores, "plain")),
                  ("ray again", dict.fromkeys(ray_cores, "ray"))]
        results = []
        for name, who in phases:
            t0 = time.time() + 1.0
            t1 = t0 + args.seconds
            refs = {}
            for c, kind in who.items():
                if kind == "plain":
                    plain[c].send((t0, t1, False))
                else:
                    refs[c] = actors[c].run.remote(t0, t1, kind == "put")
            runs = []
            for c, kind in who.items():
                if kind == "plain":
                    if not plain[c].poll(args.seconds + 60):
                        raise TimeoutError(f"the plain process on core {c} did not answer")
                    runs.append(dict(plain[c].recv(), kind=kind))
                else:
                    runs.append(dict(ray.get(refs[c], timeout=args.seconds + 60), kind=kind))
            summary = _summary(runs)
            print(f"{name}: {json.dumps(summary)}", file=sys.stderr, flush=True)
            results.append({"phase": name, "summary": summary, "runs": runs})
    finally:
        for conn in plain.values():
            conn.send(None)
        ray.shutdown()
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
