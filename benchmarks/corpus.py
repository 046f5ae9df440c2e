"""What one `ingest bench` run measures on: the corpus files, the tokenizer and the batch shape.

Every pipeline of a run reads the same Parquet files with the same tokenizer, ``seq_len`` and
``global_batch_size``. They come from a config (its sources and fields) or, without one, the
built-in demo corpus and config (the stdlib's source, GPT-2, 1024 x 32). ``--quick`` keeps the
first files up to ``QUICK_TEXT_BYTES`` of text and stops each pipeline after ``QUICK_STEPS``.
Every pipeline reads the files ``epochs`` times (default ``EPOCHS``): over one epoch of the
demo our feed makes about seven chunks of each stream, and the last ones are handed out from
memory, so a one-epoch rate over the run's later part says little about a long job.
The spec travels to the measured subprocesses as a small JSON file.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["BenchSpec", "backend_of", "load_texts", "make_spec"]

QUICK_TEXT_BYTES = 6 * 2**20  # two of the demo's eight shards
QUICK_STEPS = 40
EPOCHS = 3
# The single-core limits read at most this much text: enough for a stable rate (all of the
# demo corpus), small enough to hold in memory for any corpus.
LIMIT_TEXT_BYTES = 256 * 2**20
QUICK_LIMIT_TEXT_BYTES = 4 * 2**20


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchSpec:
    """The shared setting of one benchmark run.

    Attributes:
      files: local Parquet files, in order.
      text_column: the column holding one document per row.
      tokenizer: the tokenizer spec (``ingest.tokenize.tokenizer.load_tokenizer``).
      tokenizer_backend: the config's ``tokenizer_backend``, which the peers use too.
      seq_len, global_batch_size, num_streams: the batch shape (and our streams).
      cpus: CPUs of this machine; our workers and grain's prefetch processes.
      epochs: each pipeline reads ``files`` this many times, in order.
      steps: each pipeline stops after this many global batches; None runs every epoch.
      limit_text_bytes: the most text the single-core limits read.
      repeats: passes of the tokenizer limit (the best is the limit).
      quick: a smoke test on a slice.
      config: the ingest config for ``ingest run`` (JSON, a subset of YAML).
    """

    files: tuple[str, ...]
    text_column: str
    tokenizer: str
    tokenizer_backend: str
    seq_len: int
    global_batch_size: int
    num_streams: int
    cpus: int
    epochs: int
    steps: int | None
    limit_text_bytes: int
    repeats: int
    quick: bool
    config: dict[str, Any]

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)

    @classmethod
    def load(cls, path: str) -> BenchSpec:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        raw["files"] = tuple(raw["files"])
        return cls(**raw)

    def write_run_config(self, path: str) -> str:
        """Writes the config ``ingest run`` reads (JSON is valid YAML); returns ``path``."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.config, f, indent=1)
        return path


def _text_bytes(path: str, column: str) -> int:
    md = pq.ParquetFile(path).metadata
    ci = md.schema.to_arrow_schema().get_field_index(column)
    return sum(md.row_group(i).column(ci).total_uncompressed_size
               for i in range(md.num_row_groups))


def make_spec(config_path: str | None, *, quick: bool, steps: int | None,
              tokenizer: str | None = None, epochs: int | None = None) -> BenchSpec:
    """Builds the spec from a config (or the demo), checking that every pipeline can read it;
    ``tokenizer`` replaces the config's; ``epochs`` defaults to ``EPOCHS`` (1 when
    ``quick``).

    Raises:
      ValueError: sources that are not local Parquet files, or that use different text
        columns (the peers read one column of plain Parquet files).
    """
    from ingest.config import load_config, to_dict
    from ingest.demo import demo_config
    from ingest.sources.paths import list_files

    base = load_config(config_path) if config_path else demo_config()
    if tokenizer is not None:
        base = base.replace(tokenizer=tokenizer)
    cpus = os.cpu_count() or 1
    columns = sorted({s.text_column for s in base.sources})
    files: list[str] = []
    problems = []
    if len(columns) > 1:
        problems.append(f"the sources use text columns {columns}; `ingest bench` compares "
                        f"pipelines over one column: give every source the same text_column")
    for i, src in enumerate(base.sources):
        for f in list_files(src.paths, src.format):
            if "://" in f:
                problems.append(f"sources[{i}]: {f} is not a local file; the peers read local "
                                f"Parquet only: copy the corpus to a local folder")
            elif (src.format or "") != "parquet" and not f.endswith((".parquet", ".pq")):
                problems.append(f"sources[{i}]: {f} is not Parquet; `ingest bench` compares "
                                f"Parquet pipelines: convert it or leave it out")
            else:
                files.append(f)
    if problems:
        shown = problems[:3] + ([f"and {len(problems) - 3} more"] if len(problems) > 3 else [])
        raise ValueError("cannot benchmark this config: " + "; ".join(shown))
    if quick:
        kept, total = [], 0
        for f in files:
            kept.append(f)
            total += _text_bytes(f, columns[0])
            if total >= QUICK_TEXT_BYTES:
                break
        files = kept
    steps = steps if steps is not None else (QUICK_STEPS if quick else None)
    epochs = epochs or (1 if quick else EPOCHS)
    config = to_dict(base)  # knobs left automatic stay so: `ingest run` resolves them
    # Exactly these files, as many times as the peers read them, one worker per CPU.
    config.update(sources=[{"paths": list(files), "text_column": columns[0], "format": "parquet",
                            "weight": 1.0}],
                  num_epochs=epochs, workers=cpus)
    return BenchSpec(files=tuple(files), text_column=columns[0], tokenizer=base.tokenizer,
                     tokenizer_backend=base.runtime.tokenizer_backend,
                     seq_len=base.seq_len, global_batch_size=base.global_batch_size,
                     num_streams=base.num_streams, cpus=cpus, epochs=epochs, steps=steps,
                     limit_text_bytes=QUICK_LIMIT_TEXT_BYTES if quick else LIMIT_TEXT_BYTES,
                     repeats=1 if quick else 3, quick=quick, config=config)


def load_texts(files: tuple[str, ...], column: str, max_bytes: int | None = None
               ) -> tuple[list[str], dict[str, Any]]:
    """The documents of ``files`` as Python strings, row group by row group, up to
    ``max_bytes`` of text; nulls and empty texts are left out (and counted).

    Returns:
      the texts, and ``{documents, text_bytes, skipped, complete}`` (``complete``: every row
      group was read).
    """
    texts: list[str] = []
    nbytes = skipped = 0
    for path in files:
        f = pq.ParquetFile(path)
        for g in range(f.num_row_groups):
            if max_bytes is not None and nbytes >= max_bytes:
                return texts, {"documents": len(texts), "text_bytes": nbytes,
                               "skipped": skipped, "complete": False}
            col = f.read_row_group(g, columns=[column]).column(0)
            if pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type):
                values = [None if v is None else v.decode("utf-8", "replace")
                          for v in col.to_pylist()]
            else:
                values = col.to_pylist()
            for v in values:
                if not v:
                    skipped += 1
                    continue
                texts.append(v)
                nbytes += len(v.encode("utf-8"))
    return texts, {"documents": len(texts), "text_bytes": nbytes, "skipped": skipped,
                   "complete": True}


def backend_of(tokenizer: Any) -> str:
    """The library that runs a loaded tokenizer: a faster BPE backend, tiktoken or HF
    tokenizers."""
    return getattr(tokenizer, "backend", "tiktoken" if type(tokenizer).__name__ ==
                   "TiktokenTokenizer" else "hf tokenizers")
