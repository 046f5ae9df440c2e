"""Ray's cost per call and per chunk, without the host feed: a bare request loop over actors.

    python -m benchmarks.actor_probe [--chunk-rows 128] [--streams-per-call 1] [--epochs 3]

Starts a local Ray cluster with one CPU per worker, opens the demo's streams on two probe actors
(half each, as ``ingest run`` places them), and keeps two requests in flight per group of
``--streams-per-call`` streams, each request producing ``--chunk-rows`` rows of every stream of
its group and returning them as one object. Prints tokens/s over the whole run (from the first
request, actors already started: no head start) and after the first round of chunks.

Comparing the same chunks with more streams a call (fewer calls and objects) against larger
chunks splits what larger chunks gain into a part per call and object and a part per chunk of
a stream; benchmarks/RESULTS.md has the figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
import time

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.actor_probe",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--chunk-rows", type=int, default=128)
    p.add_argument("--streams-per-call", type=int, default=1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
    import ray

    from ingest.demo import demo_config
    from ingest.plan.build import build_plan
    from ingest.stream.kinds import open_stream
    from ingest.stream.process import one_cpu_producer

    cfg = demo_config(num_epochs=args.epochs, chunk_rows=args.chunk_rows)
    plan = build_plan(cfg)

    @ray.remote(num_cpus=1)
    class Probe:
        def __init__(self, stream_ids: list[int]):
            one_cpu_producer()
            self.streams = {s: open_stream(cfg, plan, s) for s in stream_ids}

        def ready(self) -> bool:
            return True

        def produce(self, stream_ids: list[int], n_rows: int):
            return [self.streams[s].produce(n_rows) for s in stream_ids]

    ray.init(num_cpus=args.workers, include_dashboard=False, logging_level=logging.WARNING)
    try:
        n, g = args.workers, args.streams_per_call
        mine = [[s for s in range(cfg.num_streams) if s % n == k] for k in range(n)]
        actors = [Probe.remote(m) for m in mine]
        ray.get([a.ready.remote() for a in actors], timeout=300)
        groups = [(a, m[i:i + g]) for a, m in zip(actors, mine, strict=True)
                  for i in range(0, len(m), g)]
        t0 = time.perf_counter()
        q = collections.deque((a, ids, a.produce.remote(ids, args.chunk_rows))
                              for _ in range(2) for a, ids in groups)
        rows = after = 0
        first_round_at = None
        calls = 0
        while q:
            a, ids, ref = q.popleft()
            out = ray.get(ref, timeout=300)
            calls += 1
            got = sum(c.num_rows for c in out)
            rows += got
            if first_round_at is None and calls == len(groups):
                first_round_at = time.perf_counter()
            elif first_round_at is not None:
                after += got
            for c in out:
                c.fields  # noqa: B018 -- read every row, as the host does
            live = [s for s, c in zip(ids, out, strict=True) if not c.exhausted]
            if live:
                q.append((a, live, a.produce.remote(live, args.chunk_rows)))
        end = time.perf_counter()
    finally:
        ray.shutdown()
    tokens = cfg.seq_len
    result = {"chunk_rows": args.chunk_rows, "streams_per_call": args.streams_per_call,
              "epochs": args.epochs, "seconds": end - t0,
              "tokens_per_s": rows * tokens / (end - t0),
              "tokens_per_s_after_first_round": after * tokens / (end - first_round_at)}
    print(f"{args.chunk_rows} rows, {g} stream(s) a call: {result['tokens_per_s'] / 1e6:.2f} M "
          f"tokens/s over the whole run ({result['seconds']:.2f} s), "
          f"{result['tokens_per_s_after_first_round'] / 1e6:.2f} M after the first round",
          file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
