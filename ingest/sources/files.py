"""Reading documents out of corpus files (``ingest.sources.paths`` finds the files).

Formats:
Parquet, Arrow IPC file / Feather v2, Arrow IPC stream (``datasets``' ``.arrow`` files, and its
``save_to_disk`` folders), and JSON Lines (plain or compressed: ``.jsonl.gz``, ``.json.zst``...).
A file's *row groups* are Parquet row groups, IPC record batches, or the whole file for JSONL;
units never cross them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from ingest.cache import cached_by_files
from ingest.errors import BadInputError
from ingest.sources import jsonl, spill
from ingest.sources.columns import numpy_view, one_array
from ingest.sources.paths import COMPRESSED, filesystem, format_of, is_local, read_ranges

log = logging.getLogger("ingest.sources.files")

__all__ = ["FileInfo", "describe_file", "describe_table", "position", "read_texts"]

@dataclasses.dataclass(frozen=True)
class FileInfo:
    """One corpus file and the metadata the plan is built from.

    Attributes:
      path: as given or found (local path or URI).
      format: parquet, arrow (IPC file), arrow_stream (IPC stream) or jsonl.
      size: bytes on storage.
      row_groups: rows in each row group, in file order.
      group_bytes: uncompressed bytes of the text column per row group (balances the deal).
      content_key: a hash that changes when the file's content does: the Parquet footer (with
        its column statistics) or the Arrow footer (an IPC file's; a stream has none), plus
        the file's first and last 64 KiB; all of a JSONL file; or an in-memory table's
        content.
      table: the table of an in-memory source (format ``memory``), else None.
      group_offsets: for JSONL, the (decompressed) byte offset of each group's first line,
        and the end: a file is split into groups of whole lines (``jsonl.GROUP_BYTES``), so
        that a reader holds a group, never the whole file. Empty for other formats.
    """

    path: str
    format: str
    size: int
    row_groups: tuple[int, ...]
    group_bytes: tuple[int, ...]
    content_key: str = ""
    table: pa.Table | None = dataclasses.field(default=None, repr=False, compare=False)
    group_offsets: tuple[int, ...] = ()

    @property
    def num_rows(self) -> int:
        return sum(self.row_groups)


def position(info: FileInfo, row: int, group: int | None = None) -> str:
    """Where row ``row`` (0-based, of the whole file) is, as a reader finds it: ``line N``
    (1-based) in a JSONL file, else ``row N`` and its row group."""
    if info.format == "jsonl":
        return f"line {row + 1}"
    return f"row {row}" + (f" (in row group {group})" if group is not None else "")


def describe_table(name: str, table: pa.Table, column: str, content_key: str, *,
                   tokens: bool = False) -> FileInfo:
    """An in-memory table as one "file" of one row group, named ``name``."""
    _check_column(table.schema, column, name, tokens=tokens)
    return FileInfo(path=name, format="memory", size=table.nbytes,
                    row_groups=(table.num_rows,),
                    group_bytes=(max(1, table.column(column).nbytes),),
                    content_key=content_key, table=table)


def describe_file(path: str, fmt: str | None, text_column: str, *,
                  tokens: bool = False, size: int | None = None) -> FileInfo:
    """Reads a file's metadata and checks its text column (``tokens``: a token-id column).
    ``size``: the file's size where a listing gave it (else one more request asks).

    Raises:
      BadInputError: reason ``corrupt_file`` (unreadable), ``missing_column`` or
        ``column_type`` (the column is absent or not string/binary, or not list<int>).
    """
    fmt = format_of(path, fmt)
    offsets: tuple[int, ...] = ()
    if fmt is None:
        raise BadInputError(
            f"{path}: unknown file type; use .parquet, .arrow/.feather or .jsonl (plain or "
            f"{'/'.join(COMPRESSED)}), or set sources[].format", reason="unknown_format",
            path=path)
    fs, local = filesystem(path)
    try:
        if size is None:
            size = fs.get_file_info(local).size
            if size is None:
                raise FileNotFoundError(f"{path}: no such file")
        if fmt == "parquet":
            key, md = _parquet_footer(fs, local, size)
            schema = md.schema.to_arrow_schema()
            _check_column(schema, text_column, path, tokens=tokens)
            ci = schema.get_field_index(text_column)
            rows = tuple(md.row_group(i).num_rows for i in range(md.num_row_groups))
            nbytes = tuple(max(1, md.row_group(i).column(ci).total_uncompressed_size)
                           for i in range(md.num_row_groups))
        elif fmt == "arrow":
            with _open_arrow(fs, local) as f:
                if f.read(6) != b"ARROW1":
                    fmt = "arrow_stream"  # no file magic: the IPC stream format
                key = _tail_hash(f, size, magic=b"ARROW1", head_bytes=1 << 16)
                reader = ipc.open_file(f) if fmt == "arrow" else _StreamBatches(f)
                _check_column(reader.schema, text_column, path, tokens=tokens)
                batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
                rows = tuple(b.num_rows for b in batches)
                nbytes = tuple(max(1, b.column(text_column).nbytes) for b in batches)
        else:
            if is_local(fs) and size > jsonl.GROUP_BYTES:
                # A large file's scan reads all of it: kept by (path, size, mtime) for the
                # next run on this machine.
                rows, offsets, key = cached_by_files(
                    f"jsonl-groups-{jsonl.GROUP_BYTES}", [local],
                    lambda: _scan_jsonl(path, fs, local), what=f"{path}: its groups of lines")
            else:
                rows, offsets, key = _scan_jsonl(path, fs, local)
            nbytes = tuple(max(1, b - a) for a, b in zip(offsets, offsets[1:], strict=False))
    except BadInputError:
        raise
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError, ValueError) as e:
        raise BadInputError(
            f"{path}: cannot read this {fmt} file ({type(e).__name__}: {e}); replace or remove "
            f"it, or set on_bad_file: skip to skip it (counted)",
            reason="corrupt_file", path=path) from e
    return FileInfo(path=path, format=fmt, size=size, row_groups=rows, group_bytes=nbytes,
                    content_key=key, group_offsets=offsets)


_HEAD_BYTES = 1 << 16  # the bytes of each end of a file that go into its content key


def _parquet_footer(fs, local: str, size: int) -> tuple[str, pq.FileMetaData]:
    """A Parquet file's content key (what ``_tail_hash`` makes of it) and parsed footer, from
    one ranged read of its ends (the whole file when small) or two at once; a footer longer
    than the tail read costs one more. Opening the file and reading through it would cost a
    round trip per read on an object store."""
    if size <= 2 * _HEAD_BYTES:
        tail = head = read_ranges(fs, local, [(0, size)])[0]
    else:
        head, tail = read_ranges(fs, local, [(0, _HEAD_BYTES), (size - _HEAD_BYTES, size)])
    h = hashlib.sha256()
    end = tail[-8:]
    n = int.from_bytes(end[:4], "little")
    if size < 8 or end[4:] != b"PAR1" or not 0 < n <= size - 8:
        pq.read_metadata(pa.BufferReader(tail))  # Arrow's own error for what this file is
        raise pa.ArrowInvalid(f"no Parquet footer at the end of the file (length {n})")
    if n + 8 > len(tail):
        tail = read_ranges(fs, local, [(size - 8 - n, size - len(tail))])[0] + tail
    footer = tail[len(tail) - 8 - n:len(tail) - 8]
    # The first and last pages too: without compression or statistics, an edit that keeps
    # every length leaves the footer as it was.
    h.update(footer)
    h.update(head[:_HEAD_BYTES])
    h.update(tail[len(tail) - min(size, _HEAD_BYTES):])
    # The footer alone, behind the magic, reads as the file's (its offsets are not followed).
    md = pq.read_metadata(pa.BufferReader(b"PAR1" + footer + end))
    return h.hexdigest()[:16], md


def _tail_hash(f, size: int, *, magic: bytes, head_bytes: int) -> str:
    """Hashes a file's footer (format: ``<footer><int32 length><magic>``) and its head."""
    h = hashlib.sha256()
    tail = 4 + len(magic)
    if size >= tail:
        f.seek(size - tail)
        end = f.read(tail)
        if end[4:] == magic:
            n = int.from_bytes(end[:4], "little")
            if 0 < n <= size - tail:
                f.seek(size - tail - n)
                h.update(f.read(n))
    if head_bytes:
        f.seek(0)
        h.update(f.read(min(size, head_bytes)))
        f.seek(max(0, size - head_bytes))
        h.update(f.read())
    f.seek(0)
    return h.hexdigest()[:16]


def _check_column(schema: pa.Schema, column: str, path: str, *, tokens: bool = False) -> None:
    name = "tokens_column" if tokens else "text_column"
    if schema.get_field_index(column) < 0:
        raise BadInputError(
            f"{path}: {name}={column!r} not found; the file has columns {schema.names}; "
            f"set sources[].{name} to one of them", reason="missing_column", path=path)
    t = schema.field(column).type
    if tokens:
        if not ((pa.types.is_list(t) or pa.types.is_large_list(t)
                 or pa.types.is_fixed_size_list(t)) and pa.types.is_integer(t.value_type)):
            raise BadInputError(
                f"{path}: tokens_column={column!r} has type {t}, expected a list of integer "
                f"token ids; point tokens_column at such a column, or use text_column for text",
                reason="column_type", path=path)
        return
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t) or pa.types.is_string_view(t)):
        raise BadInputError(
            f"{path}: text_column={column!r} has type {t}, expected string (or binary holding "
            f"UTF-8); point text_column at a text column", reason="column_type", path=path)


def read_texts(info: FileInfo, group: int, start: int, stop: int, text_column: str, *,
               sequential: bool = False) -> tuple[pa.Array, np.ndarray | None]:
    """Rows ``[start, stop)`` of row group ``group`` of the text column, as an Arrow array,
    and, for JSONL, a reason code per row for lines that are not valid JSON (else None).

    Values may be null or invalid UTF-8: the caller decides what is bad. ``sequential``: the
    caller reads the group's units in row order (``deal: row_groups``), so a Parquet group or
    JSONL file not kept decoded is decoded as it is read, from where the previous read
    stopped.

    Raises:
      BadInputError: reason ``corrupt_file`` when the data cannot be read or decoded, or no
        longer has the rows the plan counted.
    """
    if info.table is not None:
        return one_array(info.table.column(text_column).slice(start, stop - start)), None
    fs, local = filesystem(info.path)
    try:
        if sequential and info.format in ("parquet", "jsonl"):
            key = (info.path, info.size, info.content_key, group, text_column)
            with _read_lock:
                cursor = None if key in _row_groups or key in _spilled else \
                    _cursor(info, fs, local, group, text_column, start)
            if cursor is not None:
                return _read_on(cursor, info, group, start, stop, key)
        with _read_lock:
            table = _group(info, fs, local, group, text_column)
        bad = numpy_view(table.column(1).slice(start, stop - start)) if table.num_columns > 1 \
            else None
        return one_array(table.column(0).slice(start, stop - start)), bad
    except BadInputError:
        raise
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError, ValueError) as e:
        raise BadInputError(
            f"{info.path}: cannot read "
            + (f"lines {start + 1}..{stop} " if info.format == "jsonl"
               else f"rows {start}..{stop} of row group {group} ")
            + f"({type(e).__name__}: {e}); replace the file, or set on_bad_file: skip",
            reason="corrupt_file", path=info.path) from e


# Files kept open with their parsed footers (Parquet) or memory-mapped (local Arrow IPC): a
# stream reads a file's units one after another, and reopening cost a footer parse per unit
# (and a round trip per unit on object stores). Keyed by content_key too, so a rewritten file
# is never read through a stale footer.
_OPEN_FILES = 8
_read_lock = threading.Lock()
_open_files: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()


def _open(info: FileInfo, fs, local: str):
    """An open ParquetFile or IPC file reader for ``info`` (call with ``_read_lock`` held)."""
    key = (info.path, info.size, info.content_key)
    hit = _open_files.get(key)
    if hit is not None:
        _open_files.move_to_end(key)
        return hit[1]
    f = fs.open_input_file(local) if info.format == "parquet" else _open_arrow(fs, local)
    try:
        reader = pq.ParquetFile(f) if info.format == "parquet" else \
            ipc.open_file(f) if info.format == "arrow" else _StreamBatches(f)
    except BaseException:
        f.close()
        raise
    _open_files[key] = (f, reader)
    while len(_open_files) > _OPEN_FILES:
        old_f, _ = _open_files.popitem(last=False)[1]
        old_f.close()
    return reader


def _open_arrow(fs: pafs.FileSystem, local: str):
    """An Arrow IPC file, opened for reading; a local one memory-mapped, so that its
    uncompressed batches are read without a copy."""
    return pa.memory_map(local) if is_local(fs) else fs.open_input_file(local)


class _StreamBatches:
    """An Arrow IPC *stream* (no footer, so no random access) read through once: its record
    batches, which are its row groups, with an IPC file reader's ``get_batch``. Memory-mapped
    batches of a local file stay in the file; a remote file's are read into memory."""

    def __init__(self, f):
        f.seek(0)
        reader = ipc.open_stream(f)
        self.schema = reader.schema
        self._batches = list(reader)
        self.num_record_batches = len(self._batches)

    def get_batch(self, i: int) -> pa.RecordBatch:
        return self._batches[i]


# Decoded groups (Parquet row groups, IPC batches read into memory, parsed JSONL files) as
# tables whose first column is the text column, most recent last, up to this many bytes per
# process. Units are often parts of a group (unit_rows below the group's rows), and each reads
# the whole group, so decoding it once per unit was a large share of a worker's time. A worker's streams read a group's units at different
# times, so the cache helps as far as it holds the groups in use; 64 MiB keeps workers' memory
# bounded. Groups over a quarter of it go to disk once per machine instead (ingest.sources.spill) and
# are memory-mapped from there: a worker maps at most _SPILLED_MAPPED of them at a time.
_ROW_GROUP_CACHE_BYTES = 64 * 2**20
LARGE_GROUP_BYTES = _ROW_GROUP_CACHE_BYTES // 4
_SPILLED_MAPPED = 32
_row_groups: collections.OrderedDict[tuple, pa.Table] = collections.OrderedDict()
_row_group_bytes = 0  # sum of nbytes over _row_groups (a running total: summing per insert
# showed in a worker's produce time)
_spilled: collections.OrderedDict[tuple, pa.Table] = collections.OrderedDict()


def _group(info: FileInfo, fs, local: str, group: int, column: str) -> pa.Table:
    """Group ``group`` of ``info``: a table of column ``column`` and, for a JSONL file with
    malformed lines, their reason codes (call with ``_read_lock`` held)."""
    key = (info.path, info.size, info.content_key, group, column)
    table = _row_groups.get(key)
    if table is not None:
        _row_groups.move_to_end(key)
        return table
    table = _spilled.get(key)
    if table is not None:
        _spilled.move_to_end(key)
        return table
    rows = info.row_groups[group]
    # The plan's estimate of the group's decoded size says whether to look on disk first.
    if info.group_bytes[group] <= LARGE_GROUP_BYTES:
        return _decode(info, fs, local, group, column, key, large=False)
    if (table := spill.load_spilled(key, rows)) is not None:
        return _keep_mapped(key, table)
    # One process of the machine decodes it; the others wait, then map the copy it wrote.
    with spill.exclusive(key, info.group_bytes[group]):
        if (table := spill.load_spilled(key, rows)) is not None:
            return _keep_mapped(key, table)
        return _decode(info, fs, local, group, column, key, large=True)


def _decode(info: FileInfo, fs, local: str, group: int, column: str, key: tuple, *,
            large: bool) -> pa.Table:
    """Reads and decodes the group, and keeps it: in memory if small, else on disk when the
    plan said ``large``."""
    global _row_group_bytes
    if info.format == "jsonl":
        fs, local = _seekable(info, fs, local)
        table = jsonl.read_table(info.path, fs, local, column, info.row_groups[group],
                                 **_jsonl_group(info, group, local))
    else:
        reader = _open(info, fs, local)
        if info.format == "parquet":
            table = reader.read_row_group(group, columns=[column], use_threads=False)
        else:
            batch = reader.get_batch(group).select([column])
            table = pa.Table.from_batches([batch])
            if is_local(fs) and _mapped(batch, info):
                return table  # points into the mapped file: nothing to keep
    if table.num_rows != info.row_groups[group]:
        raise _changed(info, group, str(table.num_rows))
    if table.nbytes <= LARGE_GROUP_BYTES:
        _row_groups[key] = table
        _row_group_bytes += table.nbytes
        while _row_group_bytes > _ROW_GROUP_CACHE_BYTES:
            _row_group_bytes -= _row_groups.popitem(last=False)[1].nbytes
    elif large and (mapped := spill.spill(key, table)) is not None:
        return _keep_mapped(key, mapped)
    return table


# deal: row_groups reads a stream's units of a row group one after another in row order. A
# Parquet group or JSONL file that is not kept decoded (in _row_groups or on disk) is then
# read through a cursor: decoded a batch at a time from where the previous unit stopped, so
# once per pass over it, where reading it whole for every unit decoded it once per unit (a
# corpus larger than the caches). A cursor holds one batch of decoded rows and its file's
# read buffer.
_CURSORS = 32
_CURSOR_BATCH_ROWS = 1024
_CURSOR_BUFFER_BYTES = 1 << 20
_cursors: collections.OrderedDict[tuple, _Cursor] = collections.OrderedDict()


@dataclasses.dataclass
class _Cursor:
    file: Any
    batches: Iterator[pa.Table]  # the values, and for JSONL maybe reason codes (``_group``)
    row: int = 0  # rows of the group read or skipped so far
    pending: pa.Table | None = None  # decoded rows from ``row`` on, not yet handed out

    def take(self, n: int) -> list[pa.Table]:
        """The next ``n`` rows (fewer at the end of the group)."""
        out: list[pa.Table] = []
        while n > 0:
            if self.pending is None or not self.pending.num_rows:
                self.pending = next(self.batches, None)
                if self.pending is None:
                    break
            piece = self.pending.slice(0, n)
            self.pending = self.pending.slice(piece.num_rows)
            out.append(piece)
            self.row += piece.num_rows
            n -= piece.num_rows
        return out

    def close(self) -> None:
        self.file.close()


def _cursor(info: FileInfo, fs, local: str, group: int, column: str, start: int) -> _Cursor:
    """The cursor at row ``start`` of the group, taken out of ``_cursors``, or a new one at
    row 0 (call with ``_read_lock`` held)."""
    cursor = _cursors.pop((info.path, info.size, info.content_key, group, column, start), None)
    if cursor is not None:
        return cursor
    if info.format == "jsonl":
        fs, local = _seekable(info, fs, local)
        where = _jsonl_group(info, group, local)
        f = jsonl.open_range(fs, local, where["start"], where["stop"],
                             compressed=where["compressed"])
        return _Cursor(f, jsonl.parse_blocks(info.path, f, column, where["first_line"]))
    metadata = _open(info, fs, local).metadata  # the footer, parsed once per file
    f = fs.open_input_file(local)
    try:
        reader = pq.ParquetFile(f, metadata=metadata, pre_buffer=False,
                                buffer_size=_CURSOR_BUFFER_BYTES)
        batches = reader.iter_batches(batch_size=_CURSOR_BATCH_ROWS, row_groups=[group],
                                      columns=[column], use_threads=False)
    except BaseException:
        f.close()
        raise
    return _Cursor(f, (pa.Table.from_batches([b]) for b in batches))


def _read_on(cursor: _Cursor, info: FileInfo, group: int, start: int, stop: int,
             key: tuple) -> tuple[pa.Array, np.ndarray | None]:
    """Rows ``[start, stop)`` through ``cursor`` (at ``start``, or at 0: a new cursor, as
    after a resume, skips to ``start``), which is then kept for the next unit or, at the end
    of the group, closed. Returns what ``read_texts`` does."""
    rows = info.row_groups[group]
    while cursor.row < start and cursor.take(start - cursor.row):
        pass
    pieces = cursor.take(stop - start) if cursor.row == start else []
    ended = cursor.row != stop  # the group ended before ``stop``
    if ended or stop == rows:
        # At the group's end, the file's group must end too.
        ended = ended or bool(cursor.pending is not None and cursor.pending.num_rows
                              or next(cursor.batches, None) is not None)
        cursor.close()
        if ended:
            raise _changed(info, group, str(cursor.row) if cursor.row < stop
                           else f"more than {rows}")
    else:
        with _read_lock:
            _cursors[key + (stop,)] = cursor
            while len(_cursors) > _CURSORS:
                _cursors.popitem(last=False)[1].close()
    return _joined(pieces)


def _jsonl_group(info: FileInfo, group: int, local: str) -> dict:
    """Where group ``group`` of a JSONL file (at ``local``) lies: its bytes, its first line,
    and whether the file is compressed (read from its start, not seeked)."""
    compressed = local.endswith(COMPRESSED)
    if not info.group_offsets:  # described without offsets: the whole file is one group
        return {"start": 0, "stop": None, "first_line": 0, "compressed": compressed}
    return {"start": info.group_offsets[group], "stop": info.group_offsets[group + 1],
            "first_line": sum(info.row_groups[:group]), "compressed": compressed}


_copies: dict[tuple, str | None] = {}  # compressed JSONL file -> its decompressed copy


def _scan_jsonl(path: str, fs, local: str) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    """``jsonl.scan`` of a JSONL file; a compressed one of several groups is also written
    decompressed to the disk cache as it is scanned, so that this machine's readers find
    their groups by a seek without decompressing the file a second time."""
    sink = None
    if path.endswith(COMPRESSED) and spill.budget_bytes():
        with contextlib.suppress(OSError):
            os.makedirs(spill.folder(), exist_ok=True)
            sink = tempfile.NamedTemporaryFile(dir=spill.folder(), prefix=".scan-",
                                               delete=False)
    if sink is None:
        return jsonl.scan(fs, local)
    try:
        with sink:
            rows, offsets, key = jsonl.scan(fs, local, sink=sink)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(sink.name)
        raise
    if len(rows) > 1:
        ckey = (path, fs.get_file_info(local).size, key, "decompressed")
        _copies[ckey] = spill.adopt_copy(ckey, sink.name, offsets[-1])
    else:
        with contextlib.suppress(OSError):
            os.unlink(sink.name)
    return rows, offsets, key


def _seekable(info: FileInfo, fs, local: str) -> tuple[Any, str]:
    """Where to read a JSONL file's groups: a compressed file of several groups from a
    decompressed copy on the machine's disk (written once per machine, ``ingest.sources.spill``), so
    that a group is found by a seek, not by decompressing all before it; else the file."""
    if not (info.path.endswith(COMPRESSED) and len(info.row_groups) > 1):
        return fs, local
    key = (info.path, info.size, info.content_key, "decompressed")
    if key not in _copies:
        def write(tmp: str) -> None:
            with fs.open_input_stream(local) as src, open(tmp, "wb") as out:
                while data := src.read(1 << 20):
                    out.write(data)

        _copies[key] = spill.decompressed_copy(key, info.group_offsets[-1], write)
        if _copies[key] is not None:
            log.info("%s: decompressed once to %s, so that its groups are read by seeking",
                     info.path, _copies[key])
    copy = _copies[key]
    return (fs, local) if copy is None else (filesystem(copy)[0], copy)


def _changed(info: FileInfo, group: int, found: str) -> BadInputError:
    """The error for a group that no longer has the rows the plan counted (``found`` now)."""
    return BadInputError(
        f"{info.path}: " + ((f"the file has {found} lines" if len(info.row_groups) == 1 else
                             f"the group of lines from line {sum(info.row_groups[:group]) + 1} "
                             f"has {found} lines") if info.format == "jsonl" else
                            f"row group {group} has {found} rows")
        + f", and had {info.row_groups[group]} "
        f"when the plan was built: the file changed since; restart the job to plan afresh, or "
        f"set on_bad_file: skip", reason="corrupt_file", path=info.path)


def _joined(pieces: list[pa.Table]) -> tuple[pa.Array, np.ndarray | None]:
    """One unit's rows from a cursor's pieces: the values, and the reason codes if any piece
    has some. JSONL blocks parsed apart may differ in type: Arrow's reader gives strings and
    the line parser bytes (strings are then viewed as bytes), and in a tokens column a block
    with no list of ids has no usable row (nulls of the list type, as in a whole file)."""
    values = [one_array(p.column(0)) for p in pieces]
    bad = None
    if any(p.num_columns > 1 for p in pieces):
        bad = np.concatenate([numpy_view(p.column(1)) if p.num_columns > 1
                              else np.zeros(p.num_rows, np.int8) for p in pieces])
    if len(types := {v.type for v in values}) > 1:
        ids = next((t for t in types if pa.types.is_list(t)), None)
        values = [v if v.type == ids else pa.nulls(len(v), ids) for v in values] if ids else \
            [v.view(pa.binary()) if v.type == pa.string() else v for v in values]
    return (values[0] if len(values) == 1 else pa.concat_arrays(values)), bad


def _mapped(batch: pa.RecordBatch, info: FileInfo) -> bool:
    """Whether ``batch``'s buffers lie in ``info``'s memory-mapped file (not a compressed
    batch, which the reader decompressed into memory)."""
    f = _open_files[(info.path, info.size, info.content_key)][0]
    at = f.tell()
    f.seek(0)
    base = f.read_buffer(1).address
    f.seek(at)
    end = base + f.size()
    return all(base <= b.address and b.address + b.size <= end
               for b in batch.column(0).buffers() if b is not None)


def _keep_mapped(key: tuple, table: pa.Table) -> pa.Table:
    _spilled[key] = table
    while len(_spilled) > _SPILLED_MAPPED:
        _spilled.popitem(last=False)  # unmapped once no unit's array points into it
    return table
