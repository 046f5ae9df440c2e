"""The peer pipelines, each in its idiomatic form, with our tokenizer, seq_len and batch.

Run as ``python -m benchmarks.peers PEER --spec SPEC.json``; prints one JSON object. Every
peer ends in the same place as ours: six int32 ``[global_batch_size, seq_len]`` global
``jax.Array`` fields on a mesh of the local devices.

    grain      ParquetIterDataset -> RepeatIterDataset(epochs) -> map(tokenize) ->
               ConcatThenSplitIterDataset -> batch -> shift ->
               jax.make_array_from_process_local_data, in one process
    grain_mp   the same with .mp_prefetch(num_workers = CPUs) after the batch (each prefetch
               process packs its own slice of the files)
    ray_data   read_parquet (a union of one per epoch) -> map_batches(tokenize + pack +
               shift) -> iter_jax_batches, on a local Ray cluster of CPUs

The tokenizer is ``ingest.tokenize.tokenizer.load_tokenizer(spec, backend)``: the feed's own encoding call
with the feed's ``tokenizer_backend`` (``--backend tiktoken`` for tiktoken itself), so the
pipelines differ only in how they move and pack the tokens. Tokens are counted as ours are:
non-padding input tokens (a document's tokens plus its end-of-document token).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from benchmarks.corpus import BenchSpec, backend_of
from benchmarks.measure import process_start_time

__all__ = ["main", "pack_rows"]

# Our field names, and grain's ConcatThenSplit names for the same arrays.
GRAIN_FIELDS = {
    "inputs": "inputs", "targets": "targets",
    "inputs_position": "inputs_positions", "targets_position": "targets_positions",
    "inputs_segmentation": "inputs_segment_ids", "targets_segmentation": "targets_segment_ids",
}


# A median gap between batches under this fraction of the mean marks bursty delivery: far
# below a steady pipeline's ratio, far above that of Ray Data on whole-file blocks.
BURSTY_GAP_RATIO = 0.25


class _Timer:
    """First and last batch times, tokens and steps, as ``ingest run`` reports them."""

    def __init__(self, started_at: float):
        self.started_at = started_at
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.steps = 0
        self._gaps: list[float] = []
        self._marks: list[tuple[float, int]] = []  # (time, tokens so far) after each batch

    def batch(self, tokens: int) -> None:
        now = time.time()
        if self.first is None:
            self.first = now
        else:
            self._gaps.append(now - self.last)
        self.last = now
        self.tokens += tokens
        self.steps += 1
        self._marks.append((now, self.tokens))

    def summary(self, spec: BenchSpec, **extra: Any) -> dict[str, Any]:
        if self.first is None or self.last is None:
            raise RuntimeError("the pipeline delivered no batch; check the corpus and the spec")
        span = self.last - self.first
        # All tokens over first-to-last batch, exactly as HostFeed.stats() counts ours.
        return {"steps": self.steps, "tokens": self.tokens,
                "tokens_per_s": self.tokens / span if span > 0 else 0.0,
                "startup_s": self.first - self.started_at,
                "tokens_per_s_with_startup": self.tokens / (self.last - self.started_at),
                **self._steady(),
                "seq_len": spec.seq_len, "global_batch_size": spec.global_batch_size,
                **self._arrivals(), **extra}

    def _steady(self) -> dict[str, Any]:
        """The rate over the later part of the run, as ``HostFeed.stats()`` takes ours."""
        from jax_side.feed_stats import steady_window_start  # noqa: PLC0415 (not in the startup)

        m = steady_window_start(self.steps)
        if m is None:
            return {"steady_from_step": None, "steady_tokens_per_s": 0.0}
        t, tokens = self._marks[m - 1]
        span = self.last - t
        return {"steady_from_step": m,
                "steady_tokens_per_s": (self.tokens - tokens) / span if span > 0 else 0.0}

    def _arrivals(self) -> dict[str, Any]:
        """Whether batches came steadily or in bursts. A pipeline that finishes whole blocks
        before its first batch shows a median gap far below the mean: then its rate from the
        first batch on mostly measures handing out batches already made, not making them."""
        if not self._gaps:
            return {"median_gap_s": 0.0, "mean_gap_s": 0.0, "bursty": False}
        med, mean = float(np.median(self._gaps)), float(np.mean(self._gaps))
        return {"median_gap_s": med, "mean_gap_s": mean, "bursty": med < BURSTY_GAP_RATIO * mean}


def _sharding():
    import jax

    from jax_side.sharding import batch_sharding

    mesh = jax.make_mesh((jax.local_device_count(),), ("data",))
    return batch_sharding(mesh, "data")


class _Tokenize:
    """grain map: one document -> its ids and EOS, as ``inputs`` and ``targets``.

    A plain picklable callable: mp_prefetch sends the pipeline to its processes."""

    def __init__(self, tokenizer: str, backend: str, text_column: str):
        self._spec = tokenizer
        self._backend = backend
        self._column = text_column

    def __call__(self, element: dict[str, Any]) -> dict[str, np.ndarray]:
        from ingest.tokenize.tokenizer import load_tokenizer  # cached per process

        tok = load_tokenizer(self._spec, self._backend)
        text = element[self._column]
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        ids = tok.encode_batch([text])[0]
        out = np.empty(len(ids) + 1, np.int32)
        out[:-1] = ids
        out[-1] = tok.eos_id
        return {"inputs": out, "targets": out}


def _shift_right(batch: dict[str, np.ndarray], eos_id: int) -> dict[str, np.ndarray]:
    """MaxText's shift for packed grain batches: inputs are the targets moved one right."""
    out = {ours: np.asarray(batch[theirs], dtype=np.int32) for ours, theirs in GRAIN_FIELDS.items()}
    inputs = np.empty_like(out["targets"])
    inputs[:, 1:] = out["targets"][:, :-1]
    inputs[:, 0] = eos_id
    out["inputs"] = inputs
    return out


def run_grain(spec: BenchSpec, *, workers: int, backend: str) -> dict[str, Any]:
    import grain
    import jax
    from grain import experimental as gx

    from ingest.tokenize.tokenizer import load_tokenizer

    started = process_start_time()
    timer = _Timer(started)
    eos = load_tokenizer(spec.tokenizer, backend).eos_id
    sharding = _sharding()
    shape = (spec.global_batch_size, spec.seq_len)
    tokenize = _Tokenize(spec.tokenizer, backend, spec.text_column)
    ds = gx.ParquetIterDataset(list(spec.files))
    if spec.epochs > 1:
        ds = gx.RepeatIterDataset(ds, num_epochs=spec.epochs)
    ds = ds.map(tokenize)
    ds = gx.ConcatThenSplitIterDataset(ds, length_struct={"inputs": spec.seq_len,
                                                          "targets": spec.seq_len})
    ds = ds.batch(spec.global_batch_size, drop_remainder=False)
    if workers:
        from absl import flags

        flags.FLAGS.mark_as_parsed()  # grain reads absl flags; outside app.run
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    it = iter(ds)
    try:
        for batch in it:
            local = _shift_right(batch, eos)
            rows = local["inputs"].shape[0]
            if rows < spec.global_batch_size:  # the last batch: pad, as ours does
                local = {k: np.pad(v, ((0, spec.global_batch_size - rows), (0, 0)))
                         for k, v in local.items()}
            tokens = int(np.count_nonzero(local["inputs_segmentation"]))
            arrays = {k: jax.make_array_from_process_local_data(sharding, v, shape)
                      for k, v in local.items()}
            del arrays
            timer.batch(tokens)
            if spec.steps is not None and timer.steps >= spec.steps:
                break
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
    return timer.summary(spec, peer="grain_mp" if workers else "grain", workers=workers,
                         grain_version=grain.__version__ if hasattr(grain, "__version__")
                         else _version("grain"))


def pack_rows(token_lists: list[np.ndarray], eos_id: int, seq_len: int) -> dict[str, np.ndarray]:
    """Concat-and-cut packing with a left shift, as one vectorized pass (the Ray Data UDF).

    Documents (each followed by EOS) are concatenated and cut into rows of ``seq_len``;
    ``targets`` are the next tokens. The remainder shorter than a row is dropped (a stateless
    UDF cannot carry it into the next batch). Segment ids count documents in a row from 1,
    positions restart at each document and at each row; a target that is the first token of
    the next document gets ``targets_segmentation`` 0.
    """
    lengths = np.fromiter((len(t) + 1 for t in token_lists), np.int64, len(token_lists))
    flat = np.empty(int(lengths.sum()), np.int32)
    starts = np.zeros(len(flat) + 1, bool)
    at = 0
    for t in token_lists:
        flat[at:at + len(t)] = t
        flat[at + len(t)] = eos_id
        starts[at] = True
        at += len(t) + 1
    n = (len(flat) - 1) // seq_len
    cut = n * seq_len
    inputs = flat[:cut].reshape(n, seq_len)
    targets = flat[1:cut + 1].reshape(n, seq_len)
    s_in = starts[:cut].reshape(n, seq_len)
    s_tg = starts[1:cut + 1].reshape(n, seq_len)
    seg = (np.cumsum(s_in, axis=1) + ~s_in[:, :1]).astype(np.int32)
    idx = np.arange(seq_len, dtype=np.int32)
    pos = idx - np.maximum.accumulate(np.where(s_in, idx, 0), axis=1)
    return {"inputs": inputs, "targets": targets, "inputs_position": pos,
            "targets_position": pos.copy(), "inputs_segmentation": seg,
            "targets_segmentation": np.where(s_tg, 0, seg).astype(np.int32)}


def _tokenize_and_pack(batch: dict[str, np.ndarray], *, tokenizer: str, backend: str,
                       text_column: str, seq_len: int) -> dict[str, np.ndarray]:
    from ingest.tokenize.tokenizer import load_tokenizer  # cached per Ray worker process

    tok = load_tokenizer(tokenizer, backend)
    texts = [t.decode("utf-8") if isinstance(t, bytes) else t for t in batch[text_column] if t]
    return pack_rows(tok.encode_batch(texts), tok.eos_id, seq_len)


def run_ray_data(spec: BenchSpec, *, backend: str) -> dict[str, Any]:
    import os

    import ray

    started = process_start_time()
    timer = _Timer(started)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a loopback cluster
    ray.init(num_cpus=spec.cpus, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ds = ray.data.read_parquet(list(spec.files)).select_columns([spec.text_column])
        if spec.epochs > 1:  # read_parquet reads a path given twice once
            ds = ds.union(*(ray.data.read_parquet(list(spec.files)).select_columns(
                [spec.text_column]) for _ in range(spec.epochs - 1)))
        ds = ds.map_batches(_tokenize_and_pack, batch_format="numpy",
                            fn_kwargs={"tokenizer": spec.tokenizer, "backend": backend,
                                       "text_column": spec.text_column,
                                       "seq_len": spec.seq_len})
        rows_per_batch = spec.global_batch_size
        iterator = "iter_jax_batches"
        try:
            batches = iter(ds.iter_jax_batches(batch_size=rows_per_batch, drop_last=True,
                                               dtypes=np.int32))
        except (AttributeError, TypeError, ValueError) as e:
            iterator = f"iter_batches + make_array_from_process_local_data ({e})"
            batches = _iter_batches_as_arrays(ds, spec)
        try:
            for batch in batches:
                del batch
                # Every packed row is full (drop_last keeps only whole batches): B x L tokens.
                timer.batch(spec.global_batch_size * spec.seq_len)
                if spec.steps is not None and timer.steps >= spec.steps:
                    break
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # before ray.shutdown, or its finalizer fails without a cluster
    finally:
        ray.shutdown()
    return timer.summary(spec, peer="ray_data", workers=spec.cpus, iterator=iterator,
                         ray_version=ray.__version__,
                         note="per-block remainders shorter than a row are dropped")


def _iter_batches_as_arrays(ds, spec: BenchSpec):
    import jax

    sharding = _sharding()
    shape = (spec.global_batch_size, spec.seq_len)
    for b in ds.iter_batches(batch_size=spec.global_batch_size, batch_format="numpy",
                             drop_last=True):
        yield {k: jax.make_array_from_process_local_data(sharding, np.asarray(v, np.int32), shape)
               for k, v in b.items()}


def _backend_name(tokenizer: str, backend: str) -> str:
    """The library that ran the tokenizer (``auto`` resolved)."""
    from ingest.tokenize.tokenizer import load_tokenizer

    return backend_of(load_tokenizer(tokenizer, backend))


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__)
    p.add_argument("peer", choices=("grain", "grain_mp", "ray_data"))
    p.add_argument("--spec", required=True, help="the BenchSpec JSON written by ingest bench")
    p.add_argument("--backend", help="the tokenizer backend (default: the spec's, as the feed "
                   "runs it)")
    args = p.parse_args(argv)
    spec = BenchSpec.load(args.spec)
    backend = args.backend or spec.tokenizer_backend
    if args.peer == "ray_data":
        out = run_ray_data(spec, backend=backend)
    else:
        out = run_grain(spec, workers=spec.cpus if args.peer == "grain_mp" else 0,
                        backend=backend)
    out["tokenizer_backend"] = _backend_name(spec.tokenizer, backend)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
