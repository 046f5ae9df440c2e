"""Finding corpus files and reading documents out of them.

Paths may be local files, directories (searched recursively, each real file once however
symbolic links lead to it), globs, or URIs: Arrow's filesystems (``s3://``, ``gs://``,
``abfs://``, ``hdfs://``, ``file://``) and any other scheme fsspec knows (``hf://``, ``az://``,
``memory://``...; some need their package: ``gcsfs``, ``adlfs``, ``huggingface_hub``). Formats:
Parquet, Arrow IPC file / Feather v2, Arrow IPC stream (``datasets``' ``.arrow`` files, and its
``save_to_disk`` folders), and JSON Lines (plain or compressed: ``.jsonl.gz``, ``.json.zst``...).
A file's *row groups* are Parquet row groups, IPC record batches, or the whole file for JSONL;
units never cross them.
"""

from __future__ import annotations

import codecs
import collections
import dataclasses
import functools
import hashlib
import io
import json
import logging
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import pyarrow.json as pj
import pyarrow.parquet as pq

from ingest import spill
from ingest.errors import BadInputError

log = logging.getLogger("ingest.sources")

__all__ = ["FileInfo", "describe_file", "describe_table", "list_files", "position",
           "read_texts"]

SUFFIXES = {
    ".parquet": "parquet", ".pq": "parquet",
    ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow",
    ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl",
}
# JSON Lines may be compressed (``.jsonl.gz``, ``.json.zst``...): Arrow decompresses by suffix.
COMPRESSED = (".gz", ".bz2", ".lz4", ".zst")


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
        its column statistics), the Arrow footer (an IPC file's; a stream has none) plus the
        file's first and last 64 KiB, all of a JSONL file, or an in-memory table's content.
      table: the table of an in-memory source (format ``memory``), else None.
    """

    path: str
    format: str
    size: int
    row_groups: tuple[int, ...]
    group_bytes: tuple[int, ...]
    content_key: str = ""
    table: pa.Table | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def num_rows(self) -> int:
        return sum(self.row_groups)


def _filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem holding ``path`` and the path on it.

    Local paths, and the schemes Arrow has filesystems for (``s3``, ``gs``/``gcs``, ``hdfs``,
    ``abfs``/``abfss``, ``file``), are read by Arrow; every other scheme that fsspec knows
    (``hf``, ``az``, ``memory``...) through fsspec, bridged into Arrow.
    """
    if "://" not in path:
        return pafs.LocalFileSystem(), os.path.abspath(path)
    scheme, rest = path.split("://", 1)
    if scheme in _ARROW_SCHEMES:
        if scheme in ("s3", "gs", "gcs") and not _QUERY.search(rest):
            # Object stores: the path is bucket/key, and one filesystem serves the bucket (a
            # ``?`` not followed by ``option=`` is a glob's).
            return _filesystem_for(f"{scheme}://{rest.split('/', 1)[0]}"), rest
        try:
            return pafs.FileSystem.from_uri(path)
        except pa.ArrowNotImplementedError:
            pass  # this Arrow build lacks the filesystem: fsspec may have it
    fs, local = _fsspec(path, scheme)
    return _bridged(fs), local


_QUERY = re.compile(r"\?[\w.-]+=")
_ARROW_SCHEMES = ("file", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss")


@functools.lru_cache(maxsize=64)
def _filesystem_for(root: str) -> pafs.FileSystem:
    # One filesystem per bucket/host: from_uri resolves regions and credentials, too slow to
    # repeat for every unit read. Credentials come from the standard environment variables.
    return pafs.FileSystem.from_uri(root)[0]


def _fsspec(path: str, scheme: str):
    """fsspec's filesystem for ``path`` and the path on it, or an error naming what to
    install."""
    import fsspec
    from fsspec.registry import known_implementations

    try:
        return fsspec.core.url_to_fs(path)
    except ImportError as e:
        impl = known_implementations.get(scheme, {}).get("class", "")
        package = impl.split(".", 1)[0] or "the fsspec implementation of this scheme"
        raise ImportError(
            f"{path}: reading {scheme}:// paths needs the {package} package; "
            f"pip install {package}") from e
    except ValueError as e:
        if "Protocol not known" not in str(e):
            raise
        raise ValueError(
            f"{path}: unknown filesystem scheme {scheme}://; use a local path or a "
            f"URI of a scheme Arrow or fsspec knows (s3://, gs://, hf://, az://, memory://...)"
        ) from e


@functools.lru_cache(maxsize=64)
def _bridged(fs) -> pafs.FileSystem:
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs))


def _uri(given: str, on_fs: str, found: str) -> str:
    """A file ``found`` below ``on_fs`` (the path on its filesystem of the URI ``given``), as
    a URI written as ``given`` is."""
    root = on_fs.rstrip("/")
    if not _QUERY.search(given) and found.startswith(root + "/"):
        return given.rstrip("/") + found[len(root):]
    return given.split("://", 1)[0] + "://" + found.lstrip("/")


def _format_of(path: str, forced: str | None) -> str | None:
    if forced:
        return forced
    root, ext = os.path.splitext(path.lower())
    if ext in COMPRESSED:
        return "jsonl" if SUFFIXES.get(os.path.splitext(root)[1]) == "jsonl" else None
    return SUFFIXES.get(ext)


def _hidden(path: str) -> bool:
    return os.path.basename(path).startswith((".", "_"))


_MAGIC = re.compile(r"[*?[]")


def _glob_regex(pattern: str) -> re.Pattern:
    """The paths below a glob's fixed folder that ``pattern`` (relative to it) matches, with
    the shell's rules: ``*``, ``?`` and ``[...]`` never match ``/``, ``**`` as a whole part
    matches any number of folders, and a wildcard never matches a name starting with ``.``
    (as ``glob.glob`` on a local disk)."""
    out = []
    parts = pattern.split("/")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            out.append(r"(?:(?!\.)[^/]*/)*" if not last else r"(?:(?!\.)[^/]*(?:/|$))*")
            continue
        rx = "" if part.startswith(".") or not _MAGIC.search(part) else r"(?!\.)"
        j = 0
        while j < len(part):
            c = part[j]
            neg = part[j + 1:j + 2] == "!"
            # A class's first character (after a "!") is in it, even "]" (fnmatch's rule).
            end = part.find("]", j + 2 + neg) if c == "[" else -1
            if c == "*":
                rx += "[^/]*"
            elif c == "?":
                rx += "[^/]"
            elif end > 0:
                body = "".join("\\" + ch if ch in "\\[]^" else ch
                               for ch in part[j + 1 + neg:end])
                rx += "[" + ("^/" if neg else "") + body + "]"
                j = end
            else:
                rx += re.escape(c)
            j += 1
        out.append(rx + ("" if last else "/"))
    return re.compile("".join(out) + r"\Z")


def _split_glob(path: str) -> tuple[str, str]:
    """A glob's fixed leading folder (no wildcard in it) and the rest of the pattern."""
    parts = path.split("/")
    k = next(i for i, p in enumerate(parts) if _MAGIC.search(p))
    return "/".join(parts[:k]), "/".join(parts[k:])


def _walk_local(root: str, depth: int | None = None) -> list[str]:
    """The files below local folder ``root`` (at most ``depth`` folders down; None: all),
    following symbolic links, each real file once.

    The folders themselves are walked first, then the folders symbolic links lead to, each
    once: a link to a folder already walked (a loop such as ``ln -s . self``, or a second way
    to a folder) is not followed, and such links are named in a warning. A file reached by
    several paths is listed by the first one walked.
    """
    seen: set[tuple[int, int]] = set()
    files: dict[tuple[int, int], str] = {}
    skipped: list[str] = []
    pending = collections.deque([(root, 0)])  # (folder, its depth below root)
    while pending:
        top, top_depth = pending.popleft()
        ident = _identity(top)
        if ident is None or ident in seen:
            if os.path.islink(top):  # else a missing root: no files
                skipped.append(f"{top} -> {os.readlink(top)}")
            continue
        seen.add(ident)
        for folder, dirs, names in os.walk(top):  # links are queued, not followed here
            below = os.path.relpath(folder, top)
            level = top_depth + (below != "." and below.count(os.sep) + 1)
            dirs.sort()
            keep = []
            for d in dirs if depth is None or level < depth else ():
                full = os.path.join(folder, d)
                if os.path.islink(full):
                    pending.append((full, level + 1))
                elif (ident := _identity(full)) is not None and ident not in seen:
                    seen.add(ident)
                    keep.append(d)
            dirs[:] = keep
            for name in sorted(names):
                full = os.path.join(folder, name)
                ident = _identity(full)
                if ident is not None and ident not in files:
                    files[ident] = full
    if skipped:
        log.warning("%s: %d symbolic link(s) lead to a folder already read (a loop, or a second "
                    "path to it) and were not followed, so each file is read once: %s", root,
                    len(skipped), "; ".join(skipped[:10]) + (" ..." if len(skipped) > 10 else ""))
    return list(files.values())


def _identity(path: str) -> tuple[int, int] | None:
    """The (device, inode) a path leads to; None for a broken link."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _files_under(fs: pafs.FileSystem, root: str, depth: int | None = None) -> list[str]:
    """Every file below folder ``root`` of ``fs``; a local one walked by ``_walk_local``
    (``depth``: at most so many folders down)."""
    if _is_local(fs):
        return _walk_local(root, depth)
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    return [i.path for i in infos if i.type == pafs.FileType.File]


def list_files(paths: tuple[str, ...], fmt: str | None = None) -> list[str]:
    """Expands files, directories and globs into a sorted list of data files.

    Globs follow the shell's rules on every filesystem alike (``*`` stays within a folder,
    ``**`` crosses folders). A folder written by ``datasets``' ``save_to_disk`` (a
    ``state.json`` naming its ``.arrow`` files) gives the files it names, in its order.

    Raises:
      FileNotFoundError: listing every path that matched nothing, at once.
    """
    found: list[str] = []
    missing: list[str] = []
    ordered: list[list[str]] = []  # save_to_disk folders' files, each in the folder's order
    for p in paths:
        fs, base = _filesystem(p)
        is_uri = "://" in p
        if _MAGIC.search(base):
            root, rest = _split_glob(base if is_uri else p)
            given = _split_glob(p)[0] if is_uri else p
            pattern = _glob_regex(rest)
            depth = None if "**" in rest.split("/") else rest.count("/")
            walked = _files_under(fs, root if is_uri else (root or "."), depth)
            hits = []
            for f in walked:
                rel = f[len(root) + 1:] if root else f.removeprefix("./")
                if pattern.match(rel) and not _hidden(f):
                    hits.append(_uri(given, root, f) if is_uri else (f if root else rel))
            (found.extend(hits) if hits else missing.append(f"{p} (glob matched no file)"))
            continue
        info = fs.get_file_info(base)
        if info.type == pafs.FileType.File:
            found.append(p)
        elif info.type == pafs.FileType.Directory:
            listed = _files_under(fs, base)
            hits = [f for f in listed if not _hidden(f) and _format_of(f, fmt) is not None]
            hits, orders = _saved_datasets(fs, listed, hits)
            if is_uri:
                hits = [_uri(p, base, f) for f in hits]
                orders = [[_uri(p, base, f) for f in o] for o in orders]
            ordered.extend(orders)
            (found.extend(hits) if hits else missing.append(
                f"{p} (directory holds no .parquet/.arrow/.feather/.jsonl(.gz) file)"))
        else:
            missing.append(p)
    if missing:
        raise FileNotFoundError(
            f"{len(missing)} source path(s) not found: " + "; ".join(missing)
            + ". Check sources[].paths in the config.")
    out = sorted(dict.fromkeys(found))
    for files in ordered:
        # The folder's files take the places they sort to, in the folder's own order.
        names = set(files)
        at = [i for i, f in enumerate(out) if f in names]
        for i, f in zip(at, dict.fromkeys(files), strict=True):
            out[i] = f
    return out


def _saved_datasets(fs: pafs.FileSystem, listed: list[str], hits: list[str]
                    ) -> tuple[list[str], list[list[str]]]:
    """``hits`` where each folder holding a ``state.json`` with ``_data_files`` (written by
    ``datasets``' ``save_to_disk``) keeps only the files it names, and each such folder's
    files in its order."""
    out, ordered = hits, []
    for state in sorted(f for f in listed if os.path.basename(f) == "state.json"):
        folder = state[:-len("state.json")]
        try:
            with fs.open_input_stream(state) as f:
                names = [d["filename"] for d in json.loads(f.read())["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a save_to_disk folder: its files are read as any others
        named = [folder + n for n in names]
        ours = set(named)
        out = [h for h in out if h in ours or not (h.startswith(folder)
                                                    and "/" not in h[len(folder):])]
        kept = set(out)
        ordered.append([n for n in named if n in kept])
    return out, ordered


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
                  tokens: bool = False) -> FileInfo:
    """Reads a file's metadata and checks its text column (``tokens``: a token-id column).

    Raises:
      BadInputError: reason ``corrupt_file`` (unreadable), ``missing_column`` or
        ``column_type`` (the column is absent or not string/binary, or not list<int>).
    """
    fmt = _format_of(path, fmt)
    if fmt is None:
        raise BadInputError(
            f"{path}: unknown file type; use .parquet, .arrow/.feather or .jsonl (plain or "
            f"{'/'.join(COMPRESSED)}), or set sources[].format", reason="unknown_format",
            path=path)
    fs, local = _filesystem(path)
    try:
        size = fs.get_file_info(local).size
        if fmt == "parquet":
            with fs.open_input_file(local) as f:
                key = _tail_hash(f, size, magic=b"PAR1", head_bytes=0)
                md = pq.ParquetFile(f).metadata
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
            n, nbytes, key = _count_lines(fs, local)
            rows, nbytes = (n,), (max(1, nbytes),)
    except BadInputError:
        raise
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError, ValueError) as e:
        raise BadInputError(
            f"{path}: cannot read this {fmt} file ({type(e).__name__}: {e}); replace or remove "
            f"it, or set on_bad_file: skip to skip it (counted)",
            reason="corrupt_file", path=path) from e
    return FileInfo(path=path, format=fmt, size=size, row_groups=rows, group_bytes=nbytes,
                    content_key=key)


def _count_lines(fs: pafs.FileSystem, local: str, block: int = 16 << 20
                 ) -> tuple[int, int, str]:
    """A JSONL file's lines (a last one without newline counts), its bytes (decompressed),
    and a hash of them, read in blocks: planning never holds a whole file in memory."""
    h = hashlib.sha256()
    lines = total = 0
    last = b"\n"
    with fs.open_input_stream(local) as f:
        while data := f.read(block):
            h.update(data)
            lines += data.count(b"\n")
            total += len(data)
            last = data[-1:]
    return lines + (last != b"\n"), total, h.hexdigest()[:16]


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
        return _one_array(info.table.column(text_column).slice(start, stop - start)), None
    fs, local = _filesystem(info.path)
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
        return _one_array(table.column(0).slice(start, stop - start)), bad
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
    return pa.memory_map(local) if _is_local(fs) else fs.open_input_file(local)


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


def _is_local(fs: pafs.FileSystem) -> bool:
    return isinstance(fs, pafs.LocalFileSystem)


# Decoded groups (Parquet row groups, IPC batches read into memory, parsed JSONL files) as
# tables whose first column is the text column, most recent last, up to this many bytes per
# process. Units are often parts of a group (unit_rows below the group's rows), and each reads
# the whole group: on the tiny-document benchmark (2,048-row groups, 256-row units) the
# decoding was 14% of a worker's time. A worker's streams read a group's units at different
# times, so the cache helps as far as it holds the groups in use; 64 MiB keeps workers' memory
# bounded. Groups over a quarter of it go to disk once per machine instead (ingest.spill) and
# are memory-mapped from there: a worker maps at most _SPILLED_MAPPED of them at a time.
_ROW_GROUP_CACHE_BYTES = 64 * 2**20
LARGE_GROUP_BYTES = _ROW_GROUP_CACHE_BYTES // 4
_SPILLED_MAPPED = 32
_row_groups: collections.OrderedDict[tuple, pa.Table] = collections.OrderedDict()
_row_group_bytes = 0  # sum of nbytes over _row_groups (a running total: summing per insert
# cost 2.5% of a worker's produce time on the demo)
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
        table = _jsonl_table(info, fs, local, column)
    else:
        reader = _open(info, fs, local)
        if info.format == "parquet":
            table = reader.read_row_group(group, columns=[column], use_threads=False)
        else:
            batch = reader.get_batch(group).select([column])
            table = pa.Table.from_batches([batch])
            if _is_local(fs) and _mapped(batch, info):
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
_JSONL_BLOCK_BYTES = 4 << 20
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
        f = fs.open_input_stream(local)  # decompressed by its suffix
        return _Cursor(f, _jsonl_blocks(info, f, column))
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


def _jsonl_blocks(info: FileInfo, f, column: str) -> Iterator[pa.Table]:
    """A JSONL file parsed a block of whole lines (about ``_JSONL_BLOCK_BYTES``) at a time,
    each as ``_jsonl_table`` parses a whole file (its reasons are per line)."""
    rest, line = b"", 0
    while True:
        data = f.read(_JSONL_BLOCK_BYTES)
        rest += data
        cut = rest.rfind(b"\n") + 1 if data else len(rest)
        if not cut:
            if not data:
                return
            continue  # a line longer than a block: read on
        block, rest = rest[:cut], rest[cut:]
        rows = block.count(b"\n") + (not block.endswith(b"\n") and len(block) > 0)
        if rows:
            yield _jsonl_parse(info, block, column, rows, first_line=line)
        line += rows
        if not data:
            return


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


def _changed(info: FileInfo, group: int, found: str) -> BadInputError:
    """The error for a group that no longer has the rows the plan counted (``found`` now)."""
    return BadInputError(
        f"{info.path}: " + (f"the file has {found} lines" if info.format == "jsonl" else
                            f"row group {group} has {found} rows")
        + f", and had {info.row_groups[group]} "
        f"when the plan was built: the file changed since; restart the job to plan afresh, or "
        f"set on_bad_file: skip", reason="corrupt_file", path=info.path)


def _joined(pieces: list[pa.Table]) -> tuple[pa.Array, np.ndarray | None]:
    """One unit's rows from a cursor's pieces: the values, and the reason codes if any piece
    has some. JSONL blocks parsed apart may differ in type: Arrow's reader gives strings and
    the line parser bytes (strings are then viewed as bytes), and in a tokens column a block
    with no list of ids has no usable row (nulls of the list type, as in a whole file)."""
    values = [_one_array(p.column(0)) for p in pieces]
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


def _jsonl_table(info: FileInfo, fs, local: str, column: str) -> pa.Table:
    """A JSONL file's ``column``, one row per line, and the reason codes of malformed lines
    (a second column, only if there are any). Compressed files (``.jsonl.gz``, ``.zst``...)
    are decompressed by their suffix."""
    with fs.open_input_stream(local) as f:
        data = f.read()
    return _jsonl_parse(info, data, column, info.row_groups[0])


def _jsonl_parse(info: FileInfo, data: bytes, column: str, rows: int, *,
                 first_line: int = 0) -> pa.Table:
    """``_jsonl_table`` of JSONL text ``data`` of ``rows`` lines, the first of them line
    ``first_line`` (0-based) of ``info``'s file. Only the file's start may hold a byte-order
    mark: a later line starting with one is malformed, which Arrow's reader would not see."""
    if not (first_line and data.startswith(codecs.BOM_UTF8)):
        table = _jsonl_by_arrow(data, column, rows)
        if table is not None:
            return table
    texts, bad = _jsonl_rows(info, data, column, first_line=first_line)
    if texts and any(isinstance(t, list) for t in texts):
        # A tokens_column: lists of ids (other rows are null or malformed).
        arr = pa.array([t if isinstance(t, list) else None for t in texts],
                       type=pa.list_(pa.int64()))
    else:
        arr = pa.array(texts, type=pa.binary())
    if not bad.any():
        return pa.table({"v": arr})
    return pa.table({"v": arr, "bad": pa.array(bad, type=pa.int8())})


_BLANK_LINE = re.compile(rb"\n[ \t\r]*\n")


def _jsonl_by_arrow(data: bytes, column: str, rows: int) -> pa.Table | None:
    """``column`` parsed by Arrow's JSON reader (5x faster than ``json.loads`` per line on
    short documents), when that is exactly what the line-by-line parser gives: valid UTF-8,
    each of the ``rows`` lines one JSON object holding the column as a string (or a list of
    integers), never null. None otherwise: the slow parser finds and names the bad lines.

    Arrow skips blank lines and reads ``{..} {..}`` on one line as two rows, so with no blank
    line, as many rows as lines means one object per line.
    """
    first = data[:data.find(b"\n")] if b"\n" in data else data
    if (_BLANK_LINE.search(data) or not first.strip(b" \t\r")
            or not data.rsplit(b"\n", 1)[-1].strip(b" \t\r") and not data.endswith(b"\n")):
        return None
    offsets = pa.py_buffer(np.array([0, len(data)], dtype=np.int64))
    try:
        pa.LargeStringArray.from_buffers(1, offsets, pa.py_buffer(data)).validate(full=True)
        value = json.loads(first.removeprefix(codecs.BOM_UTF8)).get(column)
    except (pa.ArrowInvalid, ValueError, AttributeError):
        return None
    kind = pa.list_(pa.int64()) if isinstance(value, list) else pa.string()
    parse = pj.ParseOptions(explicit_schema=pa.schema([(column, kind)]),
                            unexpected_field_behavior="ignore")
    for block in (1 << 20, min(len(data) + 1, 2**31 - 1)):  # a longer line needs one block
        try:
            table = pj.read_json(pa.BufferReader(data), parse_options=parse,
                                 read_options=pj.ReadOptions(use_threads=False,
                                                             block_size=block))
            break
        except pa.ArrowInvalid as e:
            if "straddl" not in str(e) or block > len(data):
                return None
    else:
        return None
    col = table.column(0)
    if table.num_rows != rows or col.null_count or (
            kind != pa.string() and pc.list_flatten(col).null_count):
        return None
    return pa.table({"v": col})


def _jsonl_rows(info: FileInfo, data: bytes, text_column: str, *,
                first_line: int = 0) -> tuple[list, np.ndarray]:
    """All rows of JSONL text (a file, or its lines from ``first_line`` on) as UTF-8 bytes
    (None for null), or lists of token ids, and per row the reason code of a malformed line
    (else 0), parsed a line at a time."""
    if not first_line:
        data = data.removeprefix(codecs.BOM_UTF8)
    texts: list = []
    bad = np.zeros(data.count(b"\n") + 1, dtype=np.int8)
    for lineno, line in enumerate(io.BytesIO(data)):
        # Invalid UTF-8 or bad JSON on one line is a bad *document*, not a bad file.
        try:
            obj = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            bad[lineno] = BAD_REASONS.index("invalid_utf8")
            obj = None
        except json.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict):
            bad[lineno] = bad[lineno] or BAD_REASONS.index("invalid_json")
            texts.append(None)
            continue
        if text_column not in obj:
            raise BadInputError(
                f"{info.path}: line {first_line + lineno + 1} has no field "
                f"text_column={text_column!r} (fields: {sorted(obj)}); set "
                f"sources[].text_column", reason="missing_column", path=info.path,
                row=first_line + lineno)
        value = obj[text_column]
        if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                           for v in value):
            texts.append(value)  # token ids of a tokens_column
            continue
        if value is not None and not isinstance(value, str):
            raise BadInputError(
                f"{info.path}: line {first_line + lineno + 1}: text_column={text_column!r} "
                f"holds {type(value).__name__}, expected a string", reason="column_type",
                path=info.path, row=first_line + lineno)
        texts.append(None if value is None else value.encode("utf-8", "surrogatepass"))
    return texts, bad[:len(texts)]


def decode_texts(arr: pa.Array) -> tuple[list[str | None], np.ndarray]:
    """Turns a string/binary array into Python strings.

    Returns:
      (texts, bad) where ``bad[i]`` is 0 for a usable text, else a reason code from
      ``BAD_REASONS`` (the text at a bad index is None).
    """
    n = len(arr)
    bad = np.zeros(n, dtype=np.int8)
    if pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type):
        raw = arr.to_pylist()
        texts = []
        for i, b in enumerate(raw):
            if b is None:
                texts.append(None)
                continue
            try:
                texts.append(b.decode("utf-8"))
            except UnicodeDecodeError:
                texts.append(None)
                bad[i] = BAD_REASONS.index("invalid_utf8")
        return _mark_empty(arr, texts, bad)
    try:
        arr.validate(full=True)
        texts = arr.to_pylist()
    except (pa.ArrowInvalid, UnicodeDecodeError):
        # Some value is not valid UTF-8: find which, one by one (rare, so the slow path is fine).
        texts = []
        for i in range(n):
            try:
                v = arr[i].as_py()
            except (pa.ArrowInvalid, UnicodeDecodeError):
                v = None
                bad[i] = BAD_REASONS.index("invalid_utf8")
            texts.append(v)
    return _mark_empty(arr, texts, bad)


# Reason codes for bad documents; index 0 means "good".
BAD_REASONS = ("ok", "null_text", "empty_text", "invalid_utf8", "invalid_json",
               "invalid_token_id", "tokenizer_error", "worker_crash")


def _one_array(col: pa.ChunkedArray) -> pa.Array:
    """``col`` as one array: its only chunk as it is, else the chunks joined (a copy)."""
    return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()


def numpy_view(arr: pa.Array | pa.ChunkedArray, *, nulls_ok: bool = False) -> np.ndarray:
    """A numpy copy-free view of an Arrow integer array (booleans: unpacked).

    Read off the data buffer: ``Array.to_numpy``, ``fill_null`` and ``pa.scalar`` import
    pandas on first use, which costs every worker 0.25 s and 48 MB (measured here). With
    ``nulls_ok``, the values at null slots are undefined: mask them with ``is_null()``.
    """
    if isinstance(arr, pa.ChunkedArray):
        arr = _one_array(arr)
    if arr.null_count and not nulls_ok:
        raise ValueError("numpy_view needs an array without nulls (or nulls_ok=True)")
    n = len(arr)
    if pa.types.is_boolean(arr.type):
        if n == 0:
            return np.zeros(0, dtype=bool)
        bits = np.unpackbits(np.frombuffer(arr.buffers()[1], dtype=np.uint8), bitorder="little")
        return bits[arr.offset:arr.offset + n].astype(bool)
    if not pa.types.is_integer(arr.type):
        raise TypeError(f"numpy_view takes integer or boolean arrays, got {arr.type}")
    kind = "i" if pa.types.is_signed_integer(arr.type) else "u"
    dtype = np.dtype(f"<{kind}{arr.type.bit_width // 8}")
    if n == 0:
        return np.zeros(0, dtype=dtype)
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=n, offset=arr.offset * dtype.itemsize)


def _mark_empty(arr: pa.Array, texts: list, bad: np.ndarray) -> tuple[list, np.ndarray]:
    """Marks null and empty texts, in Arrow rather than a Python loop over documents."""
    nulls = numpy_view(arr.is_null())
    empty = (numpy_view(pc.binary_length(arr), nulls_ok=True) == 0) & ~nulls
    code = np.where(nulls, BAD_REASONS.index("null_text"),
                    np.where(empty, BAD_REASONS.index("empty_text"), 0)).astype(np.int8)
    return texts, np.where(bad != 0, bad, code).astype(np.int8)
