"""The built-in demo corpus: the Python standard library's own source, as Parquet shards.

Real text that needs no download. Written once into a cache folder and reused; the
folder name carries a hash of the Python install (stdlib path and version), so a
different Python gets its own copy.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import sys
import sysconfig

import pyarrow as pa
import pyarrow.parquet as pq

from ingest.cache import cache_root, made_once
from ingest.config import Config, RuntimeOptions, SourceConfig

__all__ = ["demo_config", "write_demo_corpus"]

log = logging.getLogger("ingest.demo")

NUM_SHARDS = 8
ROW_GROUP_SIZE = 8


def write_demo_corpus(root: str | None = None) -> str:
    """Writes (once) the stdlib's ``.py`` files as Parquet shards; returns their folder."""
    stdlib = sysconfig.get_paths()["stdlib"]
    # Keyed by the Python install, not by listing its 1,800 files (0.35 s on every run).
    key = hashlib.sha256(f"{stdlib}\n{sys.version}".encode())
    out = os.path.join(root or cache_root(), f"demo-stdlib-{key.hexdigest()[:10]}")
    done = os.path.join(out, "_SUCCESS")
    if os.path.exists(done):
        return out
    files = sorted(glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True))
    files = [f for f in files if "site-packages" not in f]
    log.info("writing the demo corpus, the %s source files of the standard library in %s, "
             "as Parquet (once)", f"{len(files):,}", stdlib)
    with made_once("the demo corpus", out):
        _write_shards(files, stdlib, out)
    open(done, "w").close()
    return out


def _write_shards(files: list[str], stdlib: str, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    texts, names = [], []
    for f in files:
        with open(f, "rb") as fh:
            raw = fh.read()
        # Empty files (many __init__.py) would be empty documents, which on_bad_document: error
        # rejects; a few stdlib test files are deliberately not UTF-8. The demo keeps the rest.
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not text.strip():
            continue
        texts.append(text)
        names.append(os.path.relpath(f, stdlib))
    for i in range(NUM_SHARDS):
        part = pa.table({"path": names[i::NUM_SHARDS], "text": texts[i::NUM_SHARDS]})
        tmp = os.path.join(out, f".part-{i:05d}.parquet.tmp")
        pq.write_table(part, tmp, row_group_size=ROW_GROUP_SIZE)
        os.replace(tmp, os.path.join(out, f"part-{i:05d}.parquet"))


def demo_config(**overrides) -> Config:
    """The demo job: GPT-2 BPE, rows of 1024 tokens, batches of 32, three epochs (the job the
    benchmark measures: one epoch ends on a few CPUs before Ray is up, so the command's own
    process would make every row), one worker per CPU; the runtime knobs are the config's
    automatic ones, which give these settings:

    Chunks of 128 rows, because Ray's raylet and the host spend a fixed cost per chunk.
    Every stream runs out of its chunk at the same step, so a second request in flight per
    stream is what keeps a consumer with a training step from waiting there. One call makes
    the next chunk of all of a worker's streams (``streams_per_call``, a worker's share),
    which spreads the per-call cost over more tokens. On more CPUs a worker serves fewer
    streams and its chunks grow to keep about 1M tokens a call, within the default object-store
    bound. The measured effect of each choice is in benchmarks/RESULTS.md.
    """
    config = Config(sources=(SourceConfig(paths=(write_demo_corpus(),), text_column="text"),),
                    tokenizer="gpt2", seq_len=1024, global_batch_size=32, num_streams=16,
                    packing="concat", num_epochs=3, unit_rows=8,
                    runtime=RuntimeOptions(workers=max(1, os.cpu_count() or 1)))
    return config.replace(**{k: v for k, v in overrides.items() if v is not None})
