"""Replaying a materialized directory: the rows ``ingest materialize`` wrote, fed again.

A config whose one source is ``{kind: materialized, paths: [DIR]}`` gets a
``MaterializedPlan`` (one unit per segment) and ``ReplayStream`` streams, which have the
interface of ``ingest.stream.kinds.Stream``, so the feed, the workers, checkpoints and resume work
unchanged. A replay stream reads its segments in order, one row group at a time::

    stream 3   segment-000000 [R rows] | segment-000001 [R rows] | segment-000002 [< R]
    state      {epoch: 0, segment: 1, row: 37}  = the next row is row 37 of segment 1

Each segment is checked against the manifest's ``file_sha256`` the first time a process opens
it (once per process: later epochs reuse the check while the file is unchanged), so a damaged
segment stops the feed with its name before any of its rows are fed. Segment paths must lie
inside the directory.

Its rows are the rows the original stream produced, so with the same ``seq_len``,
``num_streams`` and any ``global_batch_size`` that ``num_streams`` divides, the batches (and
their digests) equal those of streaming the original config with that batch size.
``num_epochs`` replays the whole directory that many times (null: forever).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ingest.config import Config
from ingest.errors import BadInputError
from ingest.materialize.segments import (
    MANIFEST,
    content_sha256,
    file_sha256,
    read_manifest,
    read_segment,
)
from ingest.plan.units import Unit, UnitPlan, Units
from ingest.sources.columns import numpy_view
from ingest.sources.files import FileInfo
from ingest.stream.chunk import Chunk, ChunkStream, state_from_json
from ingest.stream.chunk_format import FIELD_PLACES, FIELDS, new_rows
from ingest.stream.state_check import StateInvalid, StateRanges, count

__all__ = ["MaterializedPlan", "ReplayState", "ReplayStream", "build_replay_plan"]

STATE_VERSION = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class MaterializedPlan(UnitPlan):
    """The plan of a materialized directory: ``files`` and ``units`` are its segments.

    Attributes:
      root: the directory.
      seq_len: tokens per row.
      stream_units: per stream, the indices of its segments in ``units``, in order.
      file_sha256: per file, the sha256 of its bytes from the manifest (None in a manifest
        without it: the segment's content is hashed instead).
    """

    root: str
    seq_len: int
    stream_units: tuple[tuple[int, ...], ...]
    file_sha256: tuple[str | None, ...] = ()


def build_replay_plan(config: Config) -> MaterializedPlan:
    """Reads the manifest of the config's materialized source and checks it fits the config.

    Raises:
      FileNotFoundError: no manifest, or segment files missing (all listed).
      ValueError: sources mixed with a materialized one, an unfinished materialization,
        seq_len or num_streams other than the directory's, segment paths outside the
        directory (absolute, with ``..``, or through a link).
    """
    kinds = [s.kind for s in config.sources]
    if len(kinds) > 1:
        raise ValueError(f"sources have kinds {kinds}: a materialized source replays rows that "
                         f"are already packed and cannot be mixed with other sources; give it "
                         f"alone (materialize the mixture instead)")
    root = config.sources[0].paths[0]
    if "://" in root:
        raise ValueError(f"sources[0].paths={root!r}: a materialized source must be a local "
                         f"directory")
    manifest = read_manifest(root)
    if manifest is None:
        raise FileNotFoundError(f"{os.path.join(root, MANIFEST)} does not exist: sources[0] "
                                f"(kind materialized) must name a directory written by "
                                f"`ingest materialize CONFIG --out {root}`")
    problems = []
    if not manifest.get("complete"):
        todo = [s for s, st in enumerate(manifest["streams"]) if not st["complete"]]
        problems.append(f"the materialization in {root} is unfinished (streams {todo[:10]}"
                        f"{' ...' if len(todo) > 10 else ''} not complete); rerun the same "
                        f"`ingest materialize` command to finish it")
    for key in ("seq_len", "num_streams"):
        if getattr(config, key) != manifest[key]:
            problems.append(f"{key}={getattr(config, key)} but {root} was materialized with "
                            f"{key}={manifest[key]}; set {key}: {manifest[key]} (rows cannot be "
                            f"re-cut)")
    if problems:
        raise ValueError("; ".join(problems))
    outside = [p for st in manifest["streams"] for seg in st["segments"]
               if (p := _outside(root, seg.get("path")))]
    if outside:
        raise ValueError(f"{len(outside)} segment path(s) in {os.path.join(root, MANIFEST)} lie "
                         f"outside {root}: " + "; ".join(outside[:20])
                         + ". Segments must lie inside the materialized directory: the manifest "
                           "or the directory was changed outside ingest. Materialize again into "
                           "a new directory (`ingest materialize CONFIG --out NEW_DIR`)")
    files, units, stream_units, missing, hashes = [], [], [], [], []
    row_bytes = len(FIELDS) * 4 * manifest["seq_len"]
    for st in manifest["streams"]:
        ids = []
        for seg in st["segments"]:
            path = os.path.join(root, seg["path"])
            hashes.append(seg.get("file_sha256"))
            size = os.path.getsize(path) if os.path.exists(path) else None
            if size != seg["bytes"]:
                missing.append(f"{path} ({'missing' if size is None else f'{size} bytes'}, "
                               f"the manifest has {seg['bytes']})")
            ids.append(len(units))
            units.append(Unit(source=0, file=len(files), group=0, row_start=0,
                              row_end=seg["rows"], nbytes=seg["rows"] * row_bytes))
            files.append(FileInfo(path=path, format="parquet", size=seg["bytes"],
                                  row_groups=(seg["rows"],), group_bytes=(seg["rows"] * row_bytes,),
                                  content_key=seg["sha256"]))
        stream_units.append(tuple(ids))
    if missing:
        raise FileNotFoundError(f"{len(missing)} segment(s) of {root} are missing or changed: "
                                + "; ".join(missing[:20])
                                + ". Materialize again into a new directory")
    blob = json.dumps([manifest["config_fingerprint"], manifest["corpus_fingerprint"],
                       manifest["seq_len"], [f.content_key for f in files],
                       [len(u) for u in stream_units]])
    return MaterializedPlan(files=tuple(files), text_columns=(), units=Units.of(units),
                            skipped_files=(), fingerprint=hashlib.sha256(blob.encode())
                            .hexdigest()[:16], root=root, seq_len=manifest["seq_len"],
                            stream_units=tuple(stream_units), file_sha256=tuple(hashes))


def _outside(root: str, rel: Any) -> str | None:
    """Why the manifest's segment path ``rel`` does not lie inside ``root`` (None if it does)."""
    if not isinstance(rel, str) or not rel:
        return f"{rel!r} is not a relative path"
    if os.path.isabs(rel) or rel.startswith(("/", "\\")):
        return f"{rel!r} is absolute"
    if ".." in rel.replace("\\", "/").split("/"):
        return f"{rel!r} climbs out with '..'"
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(root, rel))
    if os.path.commonpath([real_root, real]) != real_root:
        return f"{rel!r} resolves through a link to {real}"
    return None


# Segments whose bytes this process has checked against the manifest, keyed by what changes
# when the file does: (real path, expected hash, inode, size, mtime).
_CHECKED: set[tuple[Any, ...]] = set()
_POSITION, _TARGET_POSITION = FIELDS.index("inputs_position"), FIELDS.index("targets_position")


def _segment_error(plan: MaterializedPlan, stream_id: int, segment: int, path: str,
                   what: str) -> BadInputError:
    record = path[:-len(".parquet")] + ".json"
    return BadInputError(
        f"{path} (segment {segment} of stream {stream_id}) {what}: it was changed or damaged "
        f"after `ingest materialize` wrote it. Delete its record {record} and rerun the "
        f"`ingest materialize CONFIG --out {plan.root}` command that wrote the directory (same "
        f"config and corpus): it writes this segment and the stream's later ones again; or "
        f"materialize into a new directory", reason="corrupt_segment", path=path)


def check_segment(plan: MaterializedPlan, stream_id: int, segment: int) -> None:
    """Checks a segment's bytes (or, without ``file_sha256``, its rows) against the manifest;
    once per process while the file is unchanged.

    Raises:
      BadInputError: reason ``corrupt_segment``, naming the segment and the fix.
    """
    unit = plan.units[plan.stream_units[stream_id][segment]]
    info = plan.files[unit.file]
    want = plan.file_sha256[unit.file] if plan.file_sha256 else None
    st = os.stat(info.path)
    key = (os.path.realpath(info.path), want or info.content_key, st.st_ino, st.st_size,
           st.st_mtime_ns)
    if key in _CHECKED:
        return
    if st.st_size != info.size:
        raise _segment_error(plan, stream_id, segment, info.path,
                             f"has {st.st_size} bytes, the manifest {info.size}")
    if want is not None:
        got = file_sha256(info.path)
    else:
        want = info.content_key
        try:
            got = content_sha256(read_segment(info.path, plan.seq_len)).hexdigest()
        except (pa.ArrowException, OSError, ValueError) as e:
            raise _segment_error(plan, stream_id, segment, info.path,
                                 f"cannot be decoded ({type(e).__name__}: {e})") from e
    if got != want:
        raise _segment_error(plan, stream_id, segment, info.path,
                             f"does not match the manifest (sha256 {got[:16]}..., the manifest "
                             f"has {want[:16]}...)")
    _CHECKED.add(key)


@dataclasses.dataclass
class ReplayState:
    """Where a replay stream is; JSON at the boundary only.

    Attributes:
      epoch: pass over the directory.
      segment: index into the stream's segments.
      row: the next row in that segment.
      rows_emitted: rows produced so far.
      exhausted: no rows are left.
    """

    epoch: int = 0
    segment: int = 0
    row: int = 0
    rows_emitted: int = 0
    exhausted: bool = False

    def to_json(self) -> dict[str, Any]:
        return dict(dataclasses.asdict(self), version=STATE_VERSION, kind="replay")

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ReplayState:
        return state_from_json(cls, d, version=STATE_VERSION, kind="replay", what="replay stream",
                               hint="it was saved by a stream of another kind or ingest version")

    @classmethod
    def check(cls, st: Any, ranges: StateRanges, name: str, stream: int) -> None:
        """Checks a saved state (``to_json``) of stream ``stream``: its segment and row
        inside the stream's segments, its counters counts.

        Raises:
          StateInvalid: naming the field, its value and the allowed range.
        """
        if not isinstance(st, dict) or st.get("kind") != "replay":
            raise StateInvalid(f"{name} is not a replay state (the source is materialized)")
        ranges.epoch(st.get("epoch", 0), f"{name}.epoch")
        segments = ranges.plan.stream_units[stream]
        seg = count(st.get("segment", 0), f"{name}.segment", len(segments),
                    f"the stream has {len(segments)} segment(s)")
        rows = (int(ranges.plan.units.num_rows[segments[seg]]) if seg < len(segments) else 0)
        count(st.get("row", 0), f"{name}.row", rows, f"segment {seg} has {rows} row(s)")
        count(st.get("rows_emitted", 0), f"{name}.rows_emitted")


class ReplayStream(ChunkStream):
    """Stream ``stream_id`` of a materialized directory; the interface of ``Stream``."""

    def __init__(self, config: Config, plan: UnitPlan, stream_id: int):
        if not isinstance(plan, MaterializedPlan):
            raise TypeError(f"a materialized source needs the plan build_plan makes for it, got "
                            f"{type(plan).__name__}; build it with ingest.build_plan(config)")
        super().__init__(config, plan, stream_id)
        self._units = plan.stream_units[stream_id]
        self._file: tuple[int, pq.ParquetFile, np.ndarray] | None = None  # segment, file, ends
        self._group: tuple[int, int, list[np.ndarray]] | None = None  # segment, first row, rows
        self.set_state(ReplayState().to_json())

    def get_state(self) -> dict[str, Any]:
        return self._state.to_json()

    def set_state(self, state: dict[str, Any]) -> None:
        self._state = ReplayState.from_json(state)
        self._settle()

    @classmethod
    def check_state(cls, state: Any, ranges: StateRanges, name: str, stream: int) -> None:
        ReplayState.check(state, ranges, name, stream)

    def _rows(self, segment: int) -> int:
        return self.plan.units[self._units[segment]].num_rows

    def _settle(self) -> None:
        """Moves past segment ends (and epoch ends) so the state names a row that exists."""
        st = self._state
        epochs = self.config.num_epochs
        while not st.exhausted:
            if st.segment < len(self._units) and st.row < self._rows(st.segment):
                return
            if st.segment < len(self._units):
                st.segment, st.row = st.segment + 1, 0
                continue
            if not self._units or (epochs is not None and st.epoch + 1 >= epochs):
                st.exhausted = True
                return
            st.epoch, st.segment, st.row = st.epoch + 1, 0, 0

    def _group_at(self, segment: int, row: int) -> tuple[int, list[np.ndarray]]:
        """The row group holding ``row`` of ``segment``: its first row and six [g, L] arrays."""
        g = self._group
        if g is not None and g[0] == segment and g[1] <= row < g[1] + len(g[2][0]):
            return g[1], g[2]
        L = self.plan.seq_len
        path = self.plan.files[self.plan.units[self._units[segment]].file].path
        try:
            if self._file is None or self._file[0] != segment:
                check_segment(self.plan, self.stream_id, segment)
                f = pq.ParquetFile(path)
                rows = [f.metadata.row_group(i).num_rows // L for i in range(f.num_row_groups)]
                self._file = (segment, f, np.cumsum(rows))
            _, f, ends = self._file
            i = int(np.searchsorted(ends, row, side="right"))
            table = f.read_row_group(i, columns=list(FIELDS))
        except (pa.ArrowException, OSError) as e:
            # The bytes matched when the segment was opened: the file changed since.
            raise _segment_error(self.plan, self.stream_id, segment, path,
                                 f"cannot be read ({type(e).__name__}: {e})") from e
        arrays = [numpy_view(table.column(name)).reshape(-1, L) for name in FIELDS]
        if not np.array_equal(arrays[_POSITION], arrays[_TARGET_POSITION]):
            raise _segment_error(self.plan, self.stream_id, segment, path,
                                 "has targets_position other than inputs_position in row group "
                                 f"{i}; ingest writes both the same")
        first = int(ends[i - 1]) if i else 0
        self._group = (segment, first, arrays)
        return first, arrays

    def _produce(self, n_rows: int) -> Chunk:
        st = self._state
        out = new_rows(n_rows, self.plan.seq_len)
        got = 0
        while got < n_rows and not st.exhausted:
            first, arrays = self._group_at(st.segment, st.row)
            a = st.row - first
            take = min(n_rows - got, len(arrays[0]) - a)
            for i, (arr, (which, j)) in enumerate(zip(arrays, FIELD_PLACES, strict=True)):
                if i != _TARGET_POSITION:  # kept once, as inputs_position (checked equal)
                    out[which][j, got:got + take] = arr[a:a + take]
            got += take
            st.row += take
            self._settle()
        st.rows_emitted += got
        tokens, layout = out if got == n_rows else (np.ascontiguousarray(x[:, :got]) for x in out)
        return Chunk(self.stream_id, tokens, layout, self.get_state(), st.exhausted)

    def describe_head(self) -> str:
        """Where the stream is: ``SEGMENT row N (stream S, epoch E)``."""
        st = self._state
        if st.exhausted:
            return "the end of its data"
        path = self.plan.files[self.plan.units[self._units[st.segment]].file].path
        return f"{path} row {st.row} (stream {self.stream_id}, epoch {st.epoch})"
