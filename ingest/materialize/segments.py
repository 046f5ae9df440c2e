"""Materialized segments on disk: names, the manifest, and reading, writing and hashing a
segment (``ingest.materialize.writer`` runs the job, ``ingest.materialize.replay`` feeds the segments again).

A segment holds the six fields of ``ingest.stream.chunk_format.FIELDS`` as int32 columns with one value per
token: ``rows x seq_len`` values, row-major (row r is values ``[r L, (r + 1) L)``), in row
groups of whole rows. Flat columns decode several times faster than ``fixed_size_list<int32>``
columns, and replay is mostly decoding. A segment's ``sha256`` hashes its content, independent
of the encoding: its rows in order, each row as its six fields in ``FIELDS`` order, int32
little-endian. Its ``file_sha256`` hashes the file's bytes: replay checks it once per process
when it first opens the segment (reading the file once, which also warms the page cache for
the decoding).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ingest.stream.chunk_format import FIELDS

__all__ = ["COMPLETE", "FORMAT", "FORMAT_VERSION", "MANIFEST", "SEGMENT_FILE", "SegmentWriter",
           "content_sha256", "file_sha256", "load_json", "read_manifest", "read_segment",
           "segment_name", "stream_dir", "write_json_atomic"]

FORMAT = "ingest.materialized"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
COMPLETE = "complete.json"
# Values per column per row group: 256 rows of 1024 tokens, 6 MiB of int32 for the six fields
# decoded; large enough for zstd and Parquet's per-group overhead, small enough that a replay
# worker holding many streams keeps one decoded group each.
GROUP_VALUES = 1 << 18
SEGMENT_FILE = re.compile(r"segment-(\d{6})\.(parquet|json)$")


def stream_dir(stream_id: int) -> str:
    return f"stream-{stream_id:05d}"


def segment_name(stream_id: int, index: int) -> str:
    """The segment's parquet path relative to the directory."""
    return f"{stream_dir(stream_id)}/segment-{index:06d}.parquet"


def write_json_atomic(path: str, obj: Any) -> None:
    """Writes JSON under a hidden temporary name, syncs it, and renames it over ``path``."""
    d, name = os.path.split(path)
    tmp = os.path.join(d, f".{name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); it was damaged outside ingest. "
                         f"Delete it (and, for a segment record, its segment and every later "
                         f"one of that stream) and rerun `ingest materialize`") from e


def read_manifest(root: str) -> dict[str, Any] | None:
    """The directory's manifest, or None if it has none.

    Raises:
      ValueError: not a manifest of this format and version.
    """
    path = os.path.join(root, MANIFEST)
    if not os.path.exists(path):
        return None
    m = load_json(path)
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(f"{path} is not an ingest materialization manifest (format "
                         f"{m.get('format') if isinstance(m, dict) else None!r}, expected "
                         f"{FORMAT!r}); choose another directory")
    if m.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path} has format version {m.get('version')!r}; this ingest reads "
                         f"version {FORMAT_VERSION}. Materialize again into a new directory")
    return m


def read_segment(path: str, seq_len: int) -> np.ndarray:
    """All rows of one segment file as int32 ``[6, rows, seq_len]`` (``FIELDS`` order)."""
    table = pq.read_table(path, columns=list(FIELDS))
    return np.stack([table.column(f).to_numpy().reshape(-1, seq_len) for f in FIELDS])


def file_sha256(path: str) -> str:
    """The sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def content_sha256(fields: np.ndarray, h: Any | None = None) -> Any:
    """Feeds rows ``[6, n, L]`` into a sha256 (new if None): each row's fields in order."""
    h = h or hashlib.sha256()
    h.update(np.ascontiguousarray(fields.transpose(1, 0, 2), dtype="<i4").tobytes())
    return h


class SegmentWriter:
    """Writes one segment: rows arrive in pieces, row groups hold whole rows; nothing is
    visible under the final name until ``commit``."""

    def __init__(self, root: str, stream_id: int, index: int, seq_len: int):
        self.rel = segment_name(stream_id, index)
        self.path = os.path.join(root, self.rel)
        d, name = os.path.split(self.path)
        os.makedirs(d, exist_ok=True)
        self.tmp = os.path.join(d, f".{name}.tmp")
        self.record_path = self.path[:-len(".parquet")] + ".json"
        self.seq_len = seq_len
        self.group_rows = max(1, GROUP_VALUES // seq_len)
        self.rows = 0
        self.tokens = 0
        self._sha = hashlib.sha256()
        self._pending: list[np.ndarray] = []
        self._pending_rows = 0
        schema = pa.schema([(f, pa.int32()) for f in FIELDS],
                           metadata={"ingest.seq_len": str(seq_len),
                                     "ingest.layout": "row-major [rows, seq_len]"})
        self._writer = pq.ParquetWriter(self.tmp, schema, compression="zstd")

    def append(self, fields: np.ndarray) -> None:
        n = fields.shape[1]
        content_sha256(fields, self._sha)
        self.tokens += int(np.count_nonzero(fields[FIELDS.index("inputs_segmentation")]))
        self.rows += n
        self._pending.append(fields)
        self._pending_rows += n
        if self._pending_rows >= self.group_rows:
            self._flush(final=False)

    def _flush(self, *, final: bool) -> None:
        if not self._pending_rows:
            return
        data = (np.concatenate(self._pending, axis=1) if len(self._pending) > 1
                else self._pending[0])
        at = 0
        while data.shape[1] - at >= self.group_rows or (final and at < data.shape[1]):
            g = data[:, at:at + self.group_rows]
            table = pa.table({f: pa.array(np.ascontiguousarray(g[i]).ravel())
                              for i, f in enumerate(FIELDS)})
            self._writer.write_table(table, row_group_size=table.num_rows)
            at += g.shape[1]
        rest = data[:, at:]
        self._pending = [rest] if rest.shape[1] else []
        self._pending_rows = rest.shape[1]

    def commit(self, state: dict[str, Any] | None, skip: int) -> dict[str, Any]:
        """Finishes the file, renames it into place, then writes the record that commits it."""
        self._flush(final=True)
        self._writer.close()
        with open(self.tmp, "rb") as f:
            os.fsync(f.fileno())
        file_sha = file_sha256(self.tmp)
        os.replace(self.tmp, self.path)
        record = {"path": self.rel, "rows": self.rows, "tokens": self.tokens,
                  "sha256": self._sha.hexdigest(), "file_sha256": file_sha,
                  "bytes": os.path.getsize(self.path), "resume": {"state": state, "skip": skip}}
        write_json_atomic(self.record_path, record)
        return record

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._writer.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.tmp)
