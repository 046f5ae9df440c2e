"""``SourceConfig``: one dataset of the feed's config, and its field checks."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

__all__ = ["FORMATS", "SOURCE_KINDS", "SourceConfig"]

FORMATS = ("parquet", "arrow", "jsonl")
SOURCE_KINDS = ("files", "materialized")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SourceConfig:
    """One dataset.

    Attributes:
      paths: files, directories (searched recursively) and globs; local paths or any URI
        pyarrow's filesystems accept (``s3://``, ``gs://``, ``file://``).
      text_column: the string column holding one document per row.
      tokens_column: instead of ``text_column``, a ``list<int>`` column of token ids per
        document (pre-tokenized, without the end-of-document id, which the feed appends):
        tokenizing is skipped and the rows are packed like text's. Ids must be below the
        tokenizer's ``vocab_size``.
      table: Python API only: a ``pyarrow.Table`` (or a dict of arrays) to read instead of
        files, for notebooks and tests; ``paths`` stays empty. Its content hash stands for it
        in fingerprints, so checkpoints notice a different table.
      weight: mixing weight (> 0): with several sources, each stream takes rows from each
        source in proportion to ``weight`` in tokens (``ingest.stream.mixture``); to pool files
        without weights, list them in one source.
      format: ``parquet``, ``arrow`` (IPC file / Feather v2, or IPC stream: told apart by the
        file's first bytes) or ``jsonl``; None picks by suffix.
      kind: ``files`` (text documents) or ``materialized`` (one directory written by
        ``ingest materialize``, replayed row for row by ``ingest.materialize.replay``; alone, never mixed).
    """

    paths: tuple[str, ...] = ()
    text_column: str = "text"
    tokens_column: str | None = None
    weight: float = 1.0
    format: str | None = None
    kind: str = "files"
    table: Any = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.table, dict):
            import pyarrow as pa  # noqa: PLC0415 (only for in-memory sources)

            object.__setattr__(self, "table", pa.table(self.table))

    @property
    def column(self) -> str:
        """The column read: ``tokens_column`` if set, else ``text_column``."""
        return self.tokens_column if self.tokens_column is not None else self.text_column

    def table_key(self) -> str | None:
        """A hash of the in-memory table's content (None without one)."""
        if self.table is None:
            return None
        key = getattr(self, "_table_key", None)
        if key is None:
            import pyarrow as pa  # noqa: PLC0415

            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, self.table.schema) as w:
                w.write_table(self.table)
            key = hashlib.sha256(sink.getvalue()).hexdigest()[:16]
            object.__setattr__(self, "_table_key", key)
        return key

    def problems(self, where: str) -> list[str]:
        """Every problem of this source's fields, each message naming the source ``where``
        (``sources[0]``)."""
        out = []
        if self.table is not None:
            if type(self.table).__name__ != "Table":
                out.append(f"{where}.table must be a pyarrow.Table or a dict of arrays, got "
                           f"{type(self.table).__name__}")
            if self.paths:
                out.append(f"{where} has both a table and paths {list(self.paths)!r}; give one")
        elif isinstance(self.paths, str) or not isinstance(self.paths, tuple | list):
            out.append(f"{where}.paths={self.paths!r} must be a list of paths, dirs or globs")
        elif not self.paths:
            out.append(f"{where}.paths is empty; give at least one file, directory or glob")
        elif not all(isinstance(p, str) and p for p in self.paths):
            out.append(f"{where}.paths={list(self.paths)!r} must hold non-empty strings")
        else:
            for p in self.paths:
                if "://" in p and "@" in p.split("://", 1)[1].split("/", 1)[0]:
                    # Never repeat the secret: name the scheme and bucket only.
                    out.append(f"{where}.paths: a {p.split('://')[0]}:// URI embeds credentials; "
                               f"remove them and use the standard environment variables "
                               f"(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                               f"GOOGLE_APPLICATION_CREDENTIALS) or the node's role")
        if not isinstance(self.text_column, str) or not self.text_column:
            out.append(f"{where}.text_column={self.text_column!r} must be a column name")
        if self.tokens_column is not None and (not isinstance(self.tokens_column, str)
                                               or not self.tokens_column):
            out.append(f"{where}.tokens_column={self.tokens_column!r} must be a column name "
                       f"or null")
        if isinstance(self.weight, bool) or not isinstance(self.weight, int | float) or not (
            self.weight > 0
        ):
            out.append(f"{where}.weight={self.weight!r} must be a number > 0")
        if self.format is not None and self.format not in FORMATS:
            out.append(f"{where}.format={self.format!r} must be one of {FORMATS} or null (auto)")
        if self.kind not in SOURCE_KINDS:
            out.append(f"{where}.kind={self.kind!r} must be one of {list(SOURCE_KINDS)}")
        elif (self.kind == "materialized" and isinstance(self.paths, tuple | list)
              and len(self.paths) != 1):
            out.append(f"{where}.paths={list(self.paths)!r}: a materialized source is one "
                       f"directory written by `ingest materialize`; give exactly one path")
        return out
