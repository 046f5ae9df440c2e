"""Materializing: run every stream of a finite config to its end and keep its rows on disk.

The rows go into Parquet *segments* of ``segment_rows`` rows each (a stream's last one may be
shorter), so that ``ingest.materialize.replay`` can feed them again without reading or tokenizing text::

    DIR/manifest.json                         format, config and corpus fingerprints, streams
    DIR/stream-00003/segment-000012.parquet   rows [12 R, 13 R) of stream 3   (R = segment_rows)
    DIR/stream-00003/segment-000012.json      its record: rows, tokens, sha256s, resume position
    DIR/stream-00003/complete.json            written once stream 3 is exhausted

Commit protocol: a segment is written under a hidden temporary name, renamed, and only then
is its JSON record written (also through a rename). The record commits the segment. A
resubmitted job reads the records, deletes whatever was not committed (temporary files, a
renamed segment whose record never came), skips finished streams, and reopens every other
stream at the position named by its last record: ``(state, skip)``, the stream state after a
chunk and the rows of the next chunk already kept (0 when segments end on chunk boundaries).
Streams are deterministic, so the rows written after a kill are the rows an unbroken job
would have written, none twice and none missing. For the same reason, deleting a segment's
record (of a damaged segment) has the next job write that segment and the stream's later ones
again, even in a finished stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ingest.config import Config
from ingest.dirlock import exclusive
from ingest.materialize.segments import (
    COMPLETE,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    SEGMENT_FILE,
    SegmentWriter,
    load_json,
    read_manifest,
    segment_name,
    stream_dir,
    write_json_atomic,
)
from ingest.plan.units import UnitPlan
from ingest.stream.chunk import Chunk
from ingest.stream.chunk_format import FIELDS, LAYOUT_FIELDS

__all__ = ["ChunkSource", "MaterializeSummary", "Progress", "materialize"]

DEFAULT_SEGMENT_ROWS = 4096
_SEG = LAYOUT_FIELDS.index("inputs_segmentation")


class ChunkSource(Protocol):
    """What produces the chunks: the local backend or the Ray worker pool.

    ``open`` opens each stream at ``(state, rows to skip)`` (None: its beginning);
    ``next_chunk`` returns the stream's next chunk in order.
    """

    def open(self, states: dict[int, tuple[dict[str, Any] | None, int]]) -> None: ...

    def next_chunk(self, s: int) -> Chunk: ...

    def close(self) -> None: ...


class Progress(Protocol):
    """Told where a job starts, then of every chunk written."""

    def start(self, positions: dict[int, dict[str, Any] | None], finished: list[int]) -> None:
        ...

    def update(self, stream_id: int, chunk: Chunk) -> None: ...


@dataclasses.dataclass
class MaterializeSummary:
    """What a materialize job did.

    Attributes:
      out: the directory.
      streams: streams of the config.
      streams_done_before: streams already complete when the job started (skipped).
      segments: segments in the directory at the end.
      segments_written, segments_skipped: written by this job / committed before it.
      rows, tokens: in the directory at the end (tokens: non-padding input tokens).
      rows_written, tokens_written: by this job.
      seconds: wall time of this job.
      complete: every stream is exhausted and the manifest says so.
    """

    out: str
    streams: int
    streams_done_before: int
    segments: int
    segments_written: int
    segments_skipped: int
    rows: int
    tokens: int
    rows_written: int
    tokens_written: int
    seconds: float
    complete: bool


# -- the job's record on disk --------------------------------------------------------------


def manifest_header(config: Config, plan: UnitPlan, segment_rows: int) -> dict[str, Any]:
    """Everything that must match for a resubmitted job to continue a directory."""
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "fields": list(FIELDS),
        "layout": "each field an int32 column of rows x seq_len values, row-major",
        "seq_len": config.seq_len,
        "num_streams": config.num_streams,
        "segment_rows": segment_rows,
        "config_fingerprint": config.fingerprint(),
        "config": config.output_fields(),
        "corpus_fingerprint": plan.fingerprint,
    }


def _check_same_job(saved: dict[str, Any], header: dict[str, Any], root: str) -> None:
    problems = []
    for key in ("seq_len", "num_streams", "segment_rows"):
        if saved.get(key) != header[key]:
            flag = "--segment-rows" if key == "segment_rows" else key
            problems.append(f"{flag}: the directory has {saved.get(key)!r}, this job "
                            f"{header[key]!r}")
    old, new = saved.get("config", {}), header["config"]
    for key in sorted(set(old) | set(new)):
        if key not in ("seq_len", "num_streams") and old.get(key) != new.get(key):
            problems.append(f"{key}: the directory has {old.get(key)!r}, the config "
                            f"{new.get(key)!r}")
    if saved.get("corpus_fingerprint") != header["corpus_fingerprint"]:
        problems.append(f"the corpus changed (fingerprint {saved.get('corpus_fingerprint')} in "
                        f"the directory, {header['corpus_fingerprint']} now): files were added, "
                        f"removed or rewritten")
    if problems:
        raise ValueError(f"{root} holds a materialization of another job: " + "; ".join(problems)
                         + ". Rerun with the original config, corpus and --segment-rows, or "
                           "choose a new --out directory")


@dataclasses.dataclass
class _StreamOnDisk:
    records: list[dict[str, Any]]
    complete: dict[str, Any] | None


def _scan_stream(root: str, stream_id: int) -> _StreamOnDisk:
    """Reads a stream's committed records and deletes whatever was not committed."""
    d = os.path.join(root, stream_dir(stream_id))
    if not os.path.isdir(d):
        return _StreamOnDisk([], None)
    records = []
    while os.path.exists(rec := os.path.join(d, f"segment-{len(records):06d}.json")):
        r = load_json(rec)
        want = segment_name(stream_id, len(records))
        if not isinstance(r, dict) or r.get("path") != want:
            raise ValueError(
                f"{rec} names the segment "
                f"{r.get('path') if isinstance(r, dict) else None!r}, not {want!r}: the "
                f"directory was changed outside ingest. Delete {rec} and every later segment of "
                f"{stream_dir(stream_id)}, then rerun `ingest materialize`")
        path = os.path.join(root, want)
        size = os.path.getsize(path) if os.path.exists(path) else None
        if size != r["bytes"]:
            raise ValueError(
                f"{path} is committed by {rec} with {r['bytes']} bytes, but "
                + ("it is missing" if size is None else f"it has {size}")
                + f": the directory was changed outside ingest. Delete {rec} and every later "
                  f"segment of {stream_dir(stream_id)}, then rerun `ingest materialize`")
        records.append(r)
    for name in os.listdir(d):
        m = SEGMENT_FILE.fullmatch(name)
        if name.startswith(".") or (m and int(m.group(1)) >= len(records)):
            os.remove(os.path.join(d, name))  # written by a job that stopped before its commit
    comp = os.path.join(d, COMPLETE)
    complete = load_json(comp) if os.path.exists(comp) else None
    if complete is not None and complete.get("segments") != len(records):
        # Records were deleted to have segments written again: the stream continues from
        # its last record, so it is no longer complete.
        os.remove(comp)
        complete = None
    return _StreamOnDisk(records, complete)


def _manifest(header: dict[str, Any], streams: list[_StreamOnDisk]) -> dict[str, Any]:
    out = dict(header)
    out["streams"] = [{
        "complete": st.complete is not None,
        "rows": sum(r["rows"] for r in st.records),
        "tokens": sum(r["tokens"] for r in st.records),
        "segments": [{k: r[k] for k in ("path", "rows", "tokens", "sha256", "file_sha256",
                                        "bytes") if k in r}
                     for r in st.records],
    } for st in streams]
    out["complete"] = all(st.complete is not None for st in streams)
    return out


def _exclusive(root: str) -> contextlib.AbstractContextManager[None]:
    """One job per directory: an advisory lock the kernel drops when the process dies."""
    return exclusive(root, job="ingest materialize", fix="choose another --out")


# -- the job -------------------------------------------------------------------------------


@dataclasses.dataclass
class _StreamRun:
    """One unfinished stream: where it is, and the segment being written."""

    stream_id: int
    disk: _StreamOnDisk
    state: dict[str, Any] | None  # the state the current chunk starts after
    skip: int  # rows past ``state`` already kept
    writer: SegmentWriter | None = None


def materialize(config: Config, plan: UnitPlan, out: str,
                open_source: Callable[[list[int]], ChunkSource], *,
                segment_rows: int = DEFAULT_SEGMENT_ROWS,
                progress: Progress | None = None) -> MaterializeSummary:
    """Runs every unfinished stream of ``config`` to its end, writing segments into ``out``.

    Args:
      config: a validated config with finite ``num_epochs``.
      plan: its plan.
      out: the directory (created; or a directory this job started before, to continue).
      open_source: builds the chunk source for the given stream ids (local or Ray).
      segment_rows: rows per segment.
      progress: told where the job starts and of every chunk written.

    Returns:
      What the job did and what the directory holds.

    Raises:
      ValueError: endless data, a directory of another job (naming every difference) or
        damaged outside ingest, a directory with other files, another job writing it.
    """
    t0 = time.perf_counter()
    if config.num_epochs is None:
        raise ValueError("num_epochs is null (endless data), which cannot be materialized; set "
                         "num_epochs to the number of passes to write")
    if isinstance(segment_rows, bool) or not isinstance(segment_rows, int) or segment_rows <= 0:
        raise ValueError(f"segment_rows={segment_rows!r} must be a positive integer")
    header = manifest_header(config, plan, segment_rows)
    os.makedirs(out, exist_ok=True)
    with _exclusive(out):
        disk = _open_directory(out, header, config.num_streams)
        skipped = sum(len(st.records) for st in disk)
        rows0 = sum(r["rows"] for st in disk for r in st.records)
        tokens0 = sum(r["tokens"] for st in disk for r in st.records)
        runs = {}
        for s, st in enumerate(disk):
            if st.complete is None:
                resume = st.records[-1]["resume"] if st.records else {"state": None, "skip": 0}
                runs[s] = _StreamRun(s, st, resume["state"], int(resume["skip"]))
        done_before = config.num_streams - len(runs)
        written = rows = tokens = 0
        if progress is not None:
            progress.start({s: r.state for s, r in runs.items()},
                           [s for s in range(config.num_streams) if s not in runs])
        source = open_source(sorted(runs)) if runs else None
        try:
            if source is not None:
                source.open({s: (r.state, r.skip) for s, r in runs.items()})
            # Round robin, one chunk per stream per turn: each source keeps requests in flight
            # for every stream, so every worker stays busy.
            while runs:
                for s in list(runs):
                    run = runs[s]
                    chunk = source.next_chunk(s)
                    written += _write_chunk(run, chunk, out, config.seq_len, segment_rows)
                    rows += chunk.num_rows
                    tokens += int(np.count_nonzero(chunk.layout[_SEG]))
                    if chunk.exhausted:
                        written += _finish_stream(run, chunk, out)
                        del runs[s]
                    if progress is not None:
                        progress.update(s, chunk)
        finally:
            for run in runs.values():
                if run.writer is not None:
                    run.writer.abort()
            if source is not None:
                source.close()
        manifest = _manifest(header, disk)
        write_json_atomic(os.path.join(out, MANIFEST), manifest)
    return MaterializeSummary(
        out=out, streams=config.num_streams, streams_done_before=done_before,
        segments=sum(len(st.records) for st in disk), segments_written=written,
        segments_skipped=skipped, rows=rows0 + rows, tokens=tokens0 + tokens,
        rows_written=rows, tokens_written=tokens, seconds=time.perf_counter() - t0,
        complete=manifest["complete"])


def _open_directory(out: str, header: dict[str, Any], num_streams: int) -> list[_StreamOnDisk]:
    """Checks that ``out`` is empty or holds this job, reads its streams' committed records
    (deleting what was not committed) and writes the manifest of what is there."""
    saved = read_manifest(out)
    if saved is None:
        other = sorted(n for n in os.listdir(out) if not n.startswith("."))
        if other:
            raise ValueError(f"--out {out} is not empty ({', '.join(other[:5])}"
                             f"{', ...' if len(other) > 5 else ''}) and has no "
                             f"{MANIFEST}; choose an empty or new directory")
    else:
        _check_same_job(saved, header, out)
    disk = [_scan_stream(out, s) for s in range(num_streams)]
    write_json_atomic(os.path.join(out, MANIFEST), _manifest(header, disk))
    return disk


def _finish_stream(run: _StreamRun, chunk: Chunk, out: str) -> int:
    """Commits an exhausted stream's last segment and marks it complete; returns segments
    committed."""
    committed = 0
    if run.writer is not None:
        run.disk.records.append(run.writer.commit(chunk.state_after, 0))
        run.writer = None
        committed = 1
    records = run.disk.records
    run.disk.complete = {"segments": len(records), "rows": sum(r["rows"] for r in records),
                         "tokens": sum(r["tokens"] for r in records),
                         "state": chunk.state_after}
    write_json_atomic(os.path.join(out, stream_dir(run.stream_id), COMPLETE), run.disk.complete)
    return committed


def _write_chunk(run: _StreamRun, chunk: Chunk, out: str, seq_len: int,
                 segment_rows: int) -> int:
    """Appends a chunk's rows to the stream's segments; returns segments committed."""
    committed = 0
    n = chunk.num_rows
    fields = chunk.fields
    at = 0
    while at < n:
        if run.writer is None:
            run.writer = SegmentWriter(out, run.stream_id, len(run.disk.records), seq_len)
        w = run.writer
        take = min(segment_rows - w.rows, n - at)
        w.append(fields[:, at:at + take])
        at += take
        if w.rows == segment_rows:
            # Where a job reopens the stream to write the next segment: after this chunk, or
            # ``at`` rows into it (the state before it, plus rows to skip).
            state, skip = ((chunk.state_after, 0) if at == n
                           else (run.state, run.skip + at))
            run.disk.records.append(w.commit(state, skip))
            run.writer = None
            committed += 1
    run.state, run.skip = chunk.state_after, 0
    return committed
