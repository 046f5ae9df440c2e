"""A corpus of many tiny documents, for the per-document overhead target of ``ingest bench``.

The demo corpus has 1,758 documents of 18 KB on average, so per-document work hides behind
the tokenizer. This one cuts the same standard-library source into runs of consecutive
non-blank lines of at most ``MAX_DOC_BYTES`` bytes (median about 150 bytes), going round the
demo's text again until it has ``TEXT_BYTES`` (the second round repeats documents: enough
data that the measured window is seconds, not the pipeline filling up), and writes 8 Parquet
shards and a YAML config next to them::

    python -m benchmarks.tiny_corpus          # prints the config's path
    ingest bench "$(python -m benchmarks.tiny_corpus)"
"""

from __future__ import annotations

import itertools
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from ingest.cache import cache_root
from ingest.demo import demo_config
from ingest.runtime import AUTO_FIELDS

MAX_DOC_BYTES = 200
TEXT_BYTES = 40 * 2**20  # enough that a run's steady part is long beside its startup
NUM_SHARDS = 8
ROW_GROUP_SIZE = 2048


def _tiny_documents(texts: list[str]) -> list[str]:
    docs, total = [], 0
    for text in itertools.chain.from_iterable(itertools.repeat(texts, 10)):
        cur: list[str] = []
        size = 0
        for line in text.splitlines():
            if not line.strip():
                if cur:
                    docs.append("\n".join(cur))
                    total += size
                cur, size = [], 0
                continue
            n = len(line.encode()) + 1
            if cur and size + n > MAX_DOC_BYTES:
                docs.append("\n".join(cur))
                total += size
                cur, size = [], 0
            cur.append(line[:MAX_DOC_BYTES])
            size += min(n, MAX_DOC_BYTES)
        if cur:
            docs.append("\n".join(cur))
            total += size
        if total >= TEXT_BYTES:
            break
    return docs


def write_tiny_corpus(root: str | None = None) -> str:
    """Writes (once) the tiny-document shards and their config; returns the config's path."""
    out = os.path.join(root or cache_root(), "tiny-docs-v2")
    config_path = os.path.join(out, "tiny.yaml")
    demo = demo_config()
    if not os.path.exists(os.path.join(out, f"part-{NUM_SHARDS - 1:05d}.parquet")):
        table = pq.read_table(list(demo.sources[0].paths)[0], columns=["text"])
        docs = _tiny_documents(table.column("text").to_pylist())
        os.makedirs(out, exist_ok=True)
        for i in range(NUM_SHARDS):
            tmp = os.path.join(out, f".part-{i:05d}.parquet.tmp")
            pq.write_table(pa.table({"text": docs[i::NUM_SHARDS]}), tmp,
                           row_group_size=ROW_GROUP_SIZE)
            os.replace(tmp, os.path.join(out, f"part-{i:05d}.parquet"))
    # The demo's job on these documents (its runtime settings too: chunks, requests in flight,
    # streams per call); written on every call, so it follows the demo's.
    config = {"sources": [{"paths": [out], "text_column": "text"}], "tokenizer": demo.tokenizer,
              "seq_len": demo.seq_len, "global_batch_size": demo.global_batch_size,
              "num_streams": demo.num_streams, "packing": demo.packing, "num_epochs": 1,
              "unit_rows": 256,
              **{n: getattr(demo.runtime, n) for n in AUTO_FIELDS
                 if getattr(demo.runtime, n) is not None}}
    with open(config_path + ".tmp", "w") as f:
        yaml.safe_dump(config, f)
    os.replace(config_path + ".tmp", config_path)
    return config_path


if __name__ == "__main__":
    print(write_tiny_corpus(sys.argv[1] if len(sys.argv) > 1 else None))
