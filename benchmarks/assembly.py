"""Host-side cost: turning chunks into one global batch, against a plain copy of its bytes.

Run as ``python -m benchmarks.assembly --spec SPEC.json``; prints one JSON object. Real chunks
are produced first (by our streams, in this process; not timed), then replayed into:

    hostfeed     HostFeed's own assembly (``_next_items``, per step): copy k rows per stream
                 into the local batch (up to 4 steps at once where the chunks hold their
                 rows), count tokens, snapshot the state, and form the six global arrays
                 (one jax.make_array_from_process_local_data call for the six)
    row_copy     only the row copies into a fresh local batch (64-byte aligned, as HostFeed's)
    make_array   only forming the six global arrays from a ready batch, as HostFeed does
    np_copy      np.copy of one contiguous array of the same bytes: the floor
    sweep        the same steps on synthetic chunks for larger batches (up to 512 x 4096,
                 48 MiB): the cost of forming six device arrays is mostly fixed per batch, so
                 the ratio to np.copy falls as batches grow

Every figure is the median over the steps, with ``jax.block_until_ready`` on the arrays, on a
mesh of the local devices as ``ingest run`` builds it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

from benchmarks.corpus import BenchSpec

__all__ = ["main", "measure_assembly"]

FULL_STEPS = 100
QUICK_STEPS = 30


class _ReplaySource:
    """Serves chunks produced beforehand, in order, through HostFeed's source interface."""

    def __init__(self, chunks: dict[int, list]):
        self._chunks = {s: list(c) for s, c in chunks.items()}
        self.num_workers = 0
        self.wait_s = 0.0

    def next_chunk(self, s: int):
        return self._chunks[s].pop(0)

    def close(self) -> None:
        self._chunks.clear()


def _median_us(times: list[float]) -> float:
    return statistics.median(times) * 1e6


def _arrays_then_copy(local: np.ndarray, sharding, batch: int) -> tuple[float, float]:
    """Seconds to form the global arrays from a ready local batch (as HostFeed does), then
    seconds for np.copy of the same bytes."""
    import jax

    from jax_side.batch_assembly import global_arrays

    t0 = time.perf_counter()
    arrays = global_arrays(local, sharding, batch)
    jax.block_until_ready(arrays)
    t1 = time.perf_counter()
    flat = np.copy(local)
    t2 = time.perf_counter()
    del flat, arrays
    return t1 - t0, t2 - t1


def measure_assembly(spec: BenchSpec) -> dict[str, Any]:
    import jax

    from ingest.config import Config
    from ingest.plan.build import build_plan
    from ingest.runtime import resolve_runtime
    from ingest.stream.chunk_format import FIELDS, RowPieces, batch_groups
    from ingest.stream.kinds import Stream
    from jax_side.feed import HostFeed
    from jax_side.host_buffers import aligned_empty
    from jax_side.prefetch import END
    from jax_side.sharding import batch_sharding, host_rows

    cfg = Config.from_dict(spec.config)
    chunk_rows = resolve_runtime(cfg).chunk_rows
    plan = build_plan(cfg)
    mesh = jax.make_mesh((jax.local_device_count(),), ("data",))
    sharding = batch_sharding(mesh, "data")
    rows = host_rows(sharding, cfg.global_batch_size, cfg.seq_len, cfg.num_streams)
    k = cfg.rows_per_stream
    steps = QUICK_STEPS if spec.quick else FULL_STEPS
    chunks: dict[int, list] = {}
    for s in rows.streams:
        stream = Stream(cfg, plan, s)
        # One chunk more than the steps take: a last round may look one chunk ahead.
        chunks[s] = [stream.produce(chunk_rows)
                     for _ in range(-(-steps * k // chunk_rows) + 1)]
        if sum(c.num_rows for c in chunks[s]) < steps * k:
            raise ValueError(f"stream {s} has fewer than {steps * k} rows; the corpus is too small "
                             f"for {steps} assembly steps: use a larger corpus or fewer streams")
    local_shape = (len(FIELDS), rows.stop - rows.start, cfg.seq_len)
    batch_bytes = int(np.prod(local_shape)) * 4

    out: dict[str, Any] = {"steps": steps, "batch_bytes": batch_bytes,
                           "devices": jax.local_device_count(), "rows_per_stream": k}
    try:
        feed = HostFeed(cfg, sharding=sharding, backend="local", plan=plan)
        feed._intake.source = _ReplaySource(chunks)
        times = []
        while len(times) < steps:
            # One or more steps: several at once where the chunks hold their rows.
            t0 = time.perf_counter()
            made = [item for item in feed._next_items() if item is not END]
            if not made:
                break
            jax.block_until_ready([step.arrays() for step in made])
            times += [(time.perf_counter() - t0) / len(made)] * len(made)
        feed._intake.source = None
        out["hostfeed_us"] = _median_us(times)
    except (AttributeError, TypeError) as e:
        # HostFeed's private assembly interface changed: keep the decomposition below.
        out["hostfeed_error"] = (f"HostFeed._assemble could not be driven ({type(e).__name__}: "
                                 f"{e}); update benchmarks/assembly.py")

    copy_t, make_t, np_t = [], [], []
    pos = {s: (0, 0) for s in rows.streams}  # (chunk index, rows taken)
    for _ in range(steps):
        t0 = time.perf_counter()
        local = aligned_empty(local_shape)
        pieces = RowPieces(cfg.seq_len)
        for s in rows.streams:
            ci, taken = pos[s]
            filled = 0
            while filled < k:
                c = chunks[s][ci]
                n = min(k - filled, c.num_rows - taken)
                pieces.add(c.tokens, c.layout, taken, n)
                filled += n
                taken += n
                if taken == c.num_rows:
                    ci, taken = ci + 1, 0
            pos[s] = (ci, taken)
        pieces.copy_into(batch_groups(local))
        t1 = time.perf_counter()
        make_s, np_s = _arrays_then_copy(local, sharding, cfg.global_batch_size)
        copy_t.append(t1 - t0)
        make_t.append(make_s)
        np_t.append(np_s)
    out.update(row_copy_us=_median_us(copy_t), make_array_us=_median_us(make_t),
               np_copy_us=_median_us(np_t))
    assembled = out.get("hostfeed_us", out["row_copy_us"] + out["make_array_us"])
    out["assembly_us"] = assembled
    out["assembly_over_np_copy"] = assembled / out["np_copy_us"]
    out["np_copy_bytes_per_s"] = batch_bytes / (out["np_copy_us"] * 1e-6)
    out["assembly_bytes_per_s"] = batch_bytes / (assembled * 1e-6)
    return out


# Batch shapes (global_batch_size, seq_len) of the size sweep: the demo's, then larger
# batches, where the fixed cost of forming six device arrays matters less.
SWEEP = ((32, 1024), (128, 2048), (256, 4096), (512, 4096))
SWEEP_STREAMS = 16
SWEEP_CHUNK_ROWS = 128


def measure_sweep(steps: int) -> list[dict[str, Any]]:
    """HostFeed's assembly steps (per-stream row copies into an aligned batch, then the
    global arrays) on synthetic chunks, against np.copy of the same bytes, per shape."""
    import jax

    from ingest.stream.chunk import Chunk
    from ingest.stream.chunk_format import FIELDS, RowPieces, batch_groups, new_rows
    from jax_side.host_buffers import aligned_empty
    from jax_side.sharding import batch_sharding

    mesh = jax.make_mesh((jax.local_device_count(),), ("data",))
    sharding = batch_sharding(mesh, "data")
    rng = np.random.default_rng(0)
    out = []
    for batch, seq_len in SWEEP:
        k = batch // SWEEP_STREAMS
        chunks = []
        for _ in range(SWEEP_STREAMS):
            tokens, layout = new_rows(SWEEP_CHUNK_ROWS, seq_len)
            tokens[...] = rng.integers(0, 50_000, tokens.shape, dtype=np.int32)
            layout[...] = rng.integers(0, seq_len, layout.shape, dtype=layout.dtype)
            chunks.append(Chunk(0, tokens, layout, {}, False))
        shape = (len(FIELDS), batch, seq_len)
        asm_t, copy_t = [], []
        for step in range(steps):
            t0 = time.perf_counter()
            local = aligned_empty(shape)
            pieces = RowPieces(seq_len)
            r0 = (step * k) % (SWEEP_CHUNK_ROWS - k + 1)
            for c in chunks:
                pieces.add(c.tokens, c.layout, r0, k)
            pieces.copy_into(batch_groups(local))
            t1 = time.perf_counter()
            make_s, np_s = _arrays_then_copy(local, sharding, batch)
            asm_t.append(t1 - t0 + make_s)
            copy_t.append(np_s)
        a, c = _median_us(asm_t), _median_us(copy_t)
        out.append({"global_batch_size": batch, "seq_len": seq_len,
                    "batch_bytes": int(np.prod(shape)) * 4, "assembly_us": a,
                    "np_copy_us": c, "assembly_over_np_copy": a / c})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.assembly", description=__doc__)
    p.add_argument("--spec", required=True, help="the BenchSpec JSON written by ingest bench")
    args = p.parse_args(argv)
    spec = BenchSpec.load(args.spec)
    out = measure_assembly(spec)
    out["sweep"] = measure_sweep(QUICK_STEPS if spec.quick else FULL_STEPS // 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
