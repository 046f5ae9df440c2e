"""Finding corpus files: local paths, directories, globs and URIs, each file once.

Paths may be local files, directories (searched recursively, each real file once however
symbolic links lead to it), globs, or URIs: Arrow's filesystems (``s3://``, ``gs://``,
``abfs://``, ``hdfs://``, ``file://``) and any other scheme fsspec knows (``hf://``, ``az://``,
``memory://``...; some need their package: ``gcsfs``, ``adlfs``, ``huggingface_hub``). Globs
follow the shell's rules on every filesystem alike.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import datetime
import email.utils
import functools
import json
import logging
import os
import re
import threading

import pyarrow as pa
import pyarrow.fs as pafs

from ingest.errors import BadInputError

log = logging.getLogger("ingest.sources.paths")

__all__ = ["COMPRESSED", "FileStamp", "filesystem", "format_of", "is_local", "list_files",
           "read_ranges"]

SUFFIXES = {
    ".parquet": "parquet", ".pq": "parquet",
    ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow",
    ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl",
}
# JSON Lines may be compressed (``.jsonl.gz``, ``.json.zst``...): Arrow decompresses by suffix.
COMPRESSED = (".gz", ".bz2", ".lz4", ".zst")


def filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem holding ``path`` and the path on it.

    Local paths, and the schemes Arrow has filesystems for (``s3``, ``gs``/``gcs``, ``hdfs``,
    ``abfs``/``abfss``, ``file``), are read by Arrow; every other scheme that fsspec knows
    (``hf``, ``az``, ``memory``...) through fsspec, bridged into Arrow.
    """
    if "://" not in path:
        return _local(), os.path.abspath(path)
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


@functools.cache
def _local() -> pafs.LocalFileSystem:
    # One for the process (Arrow's filesystems are thread-safe): making one is on the path of
    # every unit read.
    return pafs.LocalFileSystem()


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


def format_of(path: str, forced: str | None) -> str | None:
    if forced:
        return forced
    root, ext = os.path.splitext(path.lower())
    if ext in COMPRESSED:
        return "jsonl" if SUFFIXES.get(os.path.splitext(root)[1]) == "jsonl" else None
    return SUFFIXES.get(ext)


# What ``datasets``' ``save_to_disk`` writes beside the data: never data itself.
DATASETS_METADATA = ("state.json", "dataset_info.json", "dataset_dict.json")


def _hidden(path: str) -> bool:
    name = os.path.basename(path)
    return name.startswith((".", "_")) or name in DATASETS_METADATA


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


def _walk_local(root: str, depth: int | None = None,
                unreadable: list[tuple[str, str]] | None = None) -> list[str]:
    """The files below local folder ``root`` (at most ``depth`` folders down; None: all),
    following symbolic links, each real file once. A folder that cannot be listed and a link
    that leads nowhere (dangling, or a loop) go to ``unreadable`` as (path, why).

    The folders themselves are walked first, then the folders symbolic links lead to, each
    once: a link to a folder already walked (a loop such as ``ln -s . self``, or a second way
    to a folder) is not followed, and such links are named in a warning. A file reached by
    several paths is listed by the first one walked.
    """
    def failed(e: OSError) -> None:
        if unreadable is not None:
            unreadable.append((e.filename, f"cannot list this folder: {e.strerror}"))

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
        # Links are queued, not followed here.
        for folder, dirs, names in os.walk(top, onerror=failed):
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
                if ident is None and unreadable is not None:
                    try:
                        os.stat(full)
                    except OSError as e:
                        unreadable.append((full, f"a symbolic link to {os.readlink(full)!r} "
                                                 f"that leads to no file ({e.strerror})"))
                elif ident is not None and ident not in files:
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


def _files_under(fs: pafs.FileSystem, root: str, depth: int | None = None,
                 unreadable: list[tuple[str, str]] | None = None,
                 stamps: dict[str, FileStamp] | None = None,
                 answered: threading.Event | None = None) -> list[str]:
    """Every file below folder ``root`` of ``fs``; a local one walked by ``_walk_local``
    (``depth``: at most so many folders down; ``unreadable``: see there). A remote file's
    stamp, as its listing gives it, goes to ``stamps`` (by its path on ``fs``); ``answered``
    is set once the storage has answered a request."""
    if is_local(fs):
        return _walk_local(root, depth, unreadable)
    if (ffs := _fsspec_of(fs)) is not None:
        # fsspec's own listing, whose entries keep what the bridge into Arrow drops: ETags,
        # generations, content hashes.
        entries = _fsspec_find(ffs, root, answered)
        below = root.rstrip("/") + "/"
        out = [p for p, e in entries.items() if e.get("type") == "file"
               and p.startswith(below)]
        if stamps is not None:
            stamps.update((p, s) for p in out if (s := _fsspec_stamp(entries[p])) is not None)
        return out
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    out = [i for i in infos if i.type == pafs.FileType.File]
    if stamps is not None:
        stamps.update((i.path, _arrow_stamp(i)) for i in out if i.size is not None)
    return [i.path for i in out]


# Folders listed at once: a listing is a sequence of pages, each a round trip, so a corpus
# spread over folders is listed in about the time of its largest folder. Each folder costs a
# request at least, so past _LIST_FOLDERS folders (many small ones) a flat listing, a page per
# 1,000 keys, takes fewer requests and stays under stores' request-rate limits.
_LIST_THREADS = 16
_LIST_FOLDERS = 256


def _fsspec_find(ffs, root: str, answered: threading.Event | None = None) -> dict[str, dict]:
    """Every file below ``root`` of fsspec filesystem ``ffs``, with its listing entry: the
    folders right below ``root`` are listed by threads at once (as Arrow's S3 listing does),
    since a store lists a folder a page of keys after another (at most ``_LIST_FOLDERS``
    folders: past that, one flat listing). Sets ``answered`` once the first listing has
    come."""
    try:
        top = ffs.ls(root, detail=True)
    except FileNotFoundError:
        return {}
    if answered is not None:
        answered.set()
    out = {e["name"]: e for e in top if e.get("type") != "directory"}
    folders = [e["name"] for e in top if e.get("type") == "directory"]
    if len(folders) > _LIST_FOLDERS:
        return ffs.find(root, withdirs=False, detail=True)
    if folders:
        with concurrent.futures.ThreadPoolExecutor(min(_LIST_THREADS, len(folders)),
                                                   thread_name_prefix="ingest-list") as pool:
            for found in pool.map(lambda d: ffs.find(d, withdirs=False, detail=True), folders):
                out.update(found)
    return out


def _file_type(fs: pafs.FileSystem, path: str,
               stamps: dict[str, FileStamp]) -> pafs.FileType:
    """Whether ``path`` is a file, a folder or nothing; a remote file's stamp goes to
    ``stamps``. One request on an object store, as Arrow's ``get_file_info``."""
    if (ffs := _fsspec_of(fs)) is not None:
        try:
            entry = ffs.info(path)
        except FileNotFoundError:
            return pafs.FileType.NotFound
        if entry.get("type") != "file":
            return pafs.FileType.Directory if entry.get("type") == "directory" \
                else pafs.FileType.Unknown
        if (stamp := _fsspec_stamp(entry)) is not None:
            stamps[path] = stamp
        return pafs.FileType.File
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File and not is_local(fs) and info.size is not None:
        stamps[path] = _arrow_stamp(info)
    return info.type


@dataclasses.dataclass(frozen=True)
class FileStamp:
    """What tells, without reading a file, that it is the one described before.

    Attributes:
      size: bytes on storage.
      version: a string that changes whenever the content does: an ETag, a generation or a
        content hash where the store gives one, else the modification time (and, for a local
        file, its inode change time and inode, which no tool sets back); None where the store
        gives neither, so that nothing may be assumed unchanged.
      mtime: where ``version`` is a time, the latest time in it (seconds since the epoch): a
        file written twice within the clock's resolution keeps the same time, so a version
        is trusted only once it is older than that (``settled``). None for content versions.
    """

    size: int
    version: str | None
    mtime: float | None = None

    def settled(self, now: float, margin_s: float) -> bool:
        """Whether this stamp identifies the content: a content version, or a time at least
        ``margin_s`` before ``now`` (which covers the clock's resolution and the skew
        between this machine's clock and the store's)."""
        return self.version is not None and (self.mtime is None or self.mtime < now - margin_s)


# Keys of fsspec listing entries that change with the content: S3/Azure ETags, GCS
# generations and hashes, the Hugging Face Hub's git blob ids, object version ids.
_CONTENT_KEYS = frozenset(("ETag", "etag", "generation", "md5Hash", "crc32c", "blob_id",
                           "VersionId", "version_id"))
# ... and keys that hold a modification time (fsspec's local and GCS, s3fs, adlfs).
_TIME_KEYS = ("mtime", "LastModified", "last_modified", "updated")


def _fsspec_stamp(entry: dict) -> FileStamp | None:
    """The stamp of an fsspec listing entry; None without a size."""
    size = entry.get("size")
    if not isinstance(size, int):
        return None
    content = [f"{k}={entry[k]}" for k in sorted(_CONTENT_KEYS.intersection(entry))
               if entry[k] not in (None, "")]
    if content:
        return FileStamp(size=size, version=" ".join(content))
    for k in _TIME_KEYS:
        if (t := _seconds(entry.get(k))) is not None:
            return FileStamp(size=size, version=f"{k}={entry[k]}", mtime=t)
    return FileStamp(size=size, version=None)


def _seconds(value) -> float | None:
    """A listing's time (a number of seconds, a datetime, an ISO 8601 or HTTP date) as
    seconds since the epoch; None if it is none of these."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            value = datetime.datetime.fromisoformat(value)
        except ValueError:
            try:
                value = email.utils.parsedate_to_datetime(value)
            except (TypeError, ValueError):
                return None
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.UTC)
        return value.timestamp()
    return None


def _arrow_stamp(info: pafs.FileInfo) -> FileStamp:
    """The stamp of a file in an Arrow listing (Arrow gives sizes and times, no ETags)."""
    if info.mtime_ns is None:
        return FileStamp(size=info.size, version=None)
    return FileStamp(size=info.size, version=f"mtime_ns={info.mtime_ns}",
                     mtime=info.mtime_ns / 1e9)


def local_stamp(path: str) -> FileStamp | None:
    """The stamp of a local file (a path, or a ``file://`` URI); None for other URIs and for
    a file that cannot be reached."""
    if "://" in path:
        if not path.startswith("file://"):
            return None
        path = filesystem(path)[1]
    try:
        st = os.stat(path)
    except OSError:
        return None
    return FileStamp(size=st.st_size, version=f"{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}",
                     mtime=max(st.st_mtime, st.st_ctime))


def _fsspec_of(fs: pafs.FileSystem):
    """The fsspec filesystem behind a bridged ``fs``; None for Arrow's own."""
    if isinstance(fs, pafs.PyFileSystem) and isinstance(fs.handler, pafs.FSSpecHandler):
        return fs.handler.fs
    return None


def read_ranges(fs: pafs.FileSystem, path: str, ranges: list[tuple[int, int]]) -> list[bytes]:
    """The bytes of each ``[start, end)`` of file ``path`` of ``fs``: one request a range on
    an fsspec store (several at once where it is asynchronous, as s3fs and gcsfs are), with
    no request for the file's size; Arrow's filesystems open the file (on S3 and GCS, one
    request) and read each range.

    Raises:
      OSError: the file is missing, unreadable, or shorter than a range.
    """
    if (ffs := _fsspec_of(fs)) is not None:
        if len(ranges) == 1:
            out = [ffs.cat_file(path, start=ranges[0][0], end=ranges[0][1])]
        else:
            out = ffs.cat_ranges([path] * len(ranges), [a for a, _ in ranges],
                                 [b for _, b in ranges], on_error="raise")
    else:
        with fs.open_input_file(path) as f:
            out = [f.read_at(b - a, a) for a, b in ranges]
    for (a, b), data in zip(ranges, out, strict=True):
        if len(data) != b - a:
            raise OSError(f"read {len(data)} bytes at offset {a} where {b - a} were expected: "
                          f"the file is shorter than listed (it changed while being read)")
    return out


def list_files(paths: tuple[str, ...], fmt: str | None = None,
               unreadable: list[tuple[str, str]] | None = None,
               stamps: dict[str, FileStamp] | None = None) -> list[str]:
    """Expands files, directories and globs into a sorted list of data files.

    Globs follow the shell's rules on every filesystem alike (``*`` stays within a folder,
    ``**`` crosses folders). A folder written by ``datasets``' ``save_to_disk`` (a
    ``state.json`` naming its ``.arrow`` files) gives the files it names, in its order.

    A local folder that cannot be listed, and a data file's symbolic link that leads nowhere,
    are appended to ``unreadable`` as (path, why) where given (the caller reports or skips
    them); without it they raise.

    ``stamps``, where given, receives each remote file's ``FileStamp`` as its listing gives
    it (no request more), by the path returned. Local files have none here: ``local_stamp``.

    Raises:
      FileNotFoundError: listing every path that matched nothing, at once.
      BadInputError: reason ``corrupt_file``, for the first unreadable entry where
        ``unreadable`` is None.
    """
    problems: list[tuple[str, str]] = []
    found: list[str] = []
    missing: list[str] = []
    ordered: list[list[str]] = []  # save_to_disk folders' files, each in the folder's order
    stamps = {} if stamps is None else stamps
    for p in paths:
        if "://" in p and not p.startswith(("file://", "memory://")):
            _remote_listing(p, lambda answered, p=p: _list_one(
                p, fmt, found, missing, ordered, problems, stamps, answered))
        else:
            _list_one(p, fmt, found, missing, ordered, problems, stamps)
    problems = [(f, why) for f, why in dict.fromkeys(problems) if not _hidden(f)
                and (why.startswith("cannot list") or format_of(f, fmt) is not None)]
    if unreadable is not None:
        unreadable.extend(problems)
    elif problems:
        f, why = problems[0]
        raise BadInputError(f"{f}: {why}; fix its permissions or remove it, or set "
                            f"on_bad_file: skip to skip it (counted)", reason="corrupt_file",
                            path=f)
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


def _no_dataset_dict(fs: pafs.FileSystem, given: str, base: str, listed: list[str]) -> None:
    """Refuses a folder that holds a ``DatasetDict`` (``dataset_dict.json``, written by
    ``datasets``' ``save_to_disk``): read whole, its splits would be pooled, and a model
    would train on its validation split. The user names one split's folder instead."""
    for f in sorted(f for f in listed if f.endswith("dataset_dict.json")):
        if os.path.basename(f) != "dataset_dict.json":
            continue
        folder = f[:-len("dataset_dict.json")].rstrip("/")
        try:
            with fs.open_input_stream(f) as stream:
                splits = [str(x) for x in json.loads(stream.read())["splits"]]
        except (OSError, ValueError, KeyError, TypeError):
            splits = []
        where = given.rstrip("/") + folder[len(base.rstrip("/")):]
        example = f"{where}/{splits[0] if splits else 'train'}"
        raise ValueError(
            f"{where} is a datasets DatasetDict folder (dataset_dict.json) with "
            f"splits {splits or '(unreadable list)'}; read whole, its splits would be mixed "
            f"(training on validation data). Point sources[].paths at one split's folder, "
            f"e.g. {example!r}")


def _list_one(p: str, fmt: str | None, found: list[str], missing: list[str],
              ordered: list[list[str]], problems: list[tuple[str, str]],
              stamps: dict[str, FileStamp], answered: threading.Event | None = None) -> None:
    """``list_files`` of one path, into its lists; sets ``answered`` once the storage has
    answered a request."""
    fs, base = filesystem(p)
    is_uri = "://" in p
    under: dict[str, FileStamp] = {}  # stamps by the path on ``fs``
    if _MAGIC.search(base):
        root, rest = _split_glob(base if is_uri else p)
        given = _split_glob(p)[0] if is_uri else p
        pattern = _glob_regex(rest)
        depth = None if "**" in rest.split("/") else rest.count("/")
        walked = _files_under(fs, root if is_uri else (root or "."), depth, problems, under,
                              answered)
        hits = []
        for f in walked:
            rel = f[len(root) + 1:] if root else f.removeprefix("./")
            if pattern.match(rel) and not _hidden(f):
                hits.append(_uri(given, root, f) if is_uri else (f if root else rel))
                if f in under:
                    stamps[hits[-1]] = under[f]
        offline = p.startswith("hf://") and os.environ.get("HF_HUB_OFFLINE") == "1"
        (found.extend(hits) if hits else missing.append(
            f"{p} (glob matched no file" + ("; HF_HUB_OFFLINE=1 is set, so the Hub was not "
                                            "asked: unset it" if offline else "") + ")"))
        return
    kind = _file_type(fs, base, under)
    if answered is not None:
        answered.set()
    if kind == pafs.FileType.File:
        found.append(p)
        if base in under:
            stamps[p] = under[base]
    elif kind == pafs.FileType.Directory:
        listed = _files_under(fs, base, unreadable=problems, stamps=under)
        _no_dataset_dict(fs, p, base, listed)
        hits = [f for f in listed if not _hidden(f) and format_of(f, fmt) is not None]
        hits, orders = _saved_datasets(fs, listed, hits)
        if is_uri:
            uris = [_uri(p, base, f) for f in hits]
            stamps.update((u, under[f]) for u, f in zip(uris, hits, strict=True) if f in under)
            hits = uris
            orders = [[_uri(p, base, f) for f in o] for o in orders]
        ordered.extend(orders)
        (found.extend(hits) if hits else missing.append(
            f"{p} (directory holds no .parquet/.arrow/.feather/.jsonl(.gz) file)"))
    else:
        missing.append(p)


# A remote listing whose storage gives no first answer (no network: a gs:// listing retries
# for minutes) ends after this many seconds, in an error naming the URI. Once the storage
# answers, the listing takes as long as its pages do (a million keys are a thousand pages).
REMOTE_TIMEOUT_S = float(os.environ.get("INGEST_REMOTE_TIMEOUT_S", "20"))


def _remote_listing(uri: str, list_it) -> None:
    """Runs ``list_it(answered)`` (the listing of ``uri``, which sets the event ``answered``
    once the storage has answered a first request) in a daemon thread, waiting at most
    ``REMOTE_TIMEOUT_S`` for that answer (interruptibly): a filesystem that blocks is left
    behind rather than waited for. Its errors become one line naming the URI, the cause and
    the fix."""
    done = threading.Event()
    answered = threading.Event()
    out: list[BaseException] = []

    def run() -> None:
        try:
            list_it(answered)
        except BaseException as e:  # noqa: BLE001  (handed to the caller)
            out.append(e)
        finally:
            answered.set()
            done.set()

    threading.Thread(target=run, name=f"list {uri}", daemon=True).start()
    if not answered.wait(REMOTE_TIMEOUT_S) or not done.wait():
        raise FileNotFoundError(
            f"{uri}: no answer from its storage in {REMOTE_TIMEOUT_S:g} s (offline, or the "
            f"network blocks its endpoint); check the network and the URI, or raise "
            f"INGEST_REMOTE_TIMEOUT_S")
    if not out:
        return
    e = out[0]
    if isinstance(e, (FileNotFoundError, BadInputError, ImportError, ValueError)) \
            and uri in str(e):
        raise e
    raise FileNotFoundError(f"{uri}: cannot list it: {_cause(uri, e)}") from e


def _cause(uri: str, e: BaseException) -> str:
    """What a failed remote listing most likely means, and the fix, in a few words."""
    text = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    low = text.lower()
    if os.environ.get("HF_HUB_OFFLINE") == "1" and uri.startswith("hf://"):
        return f"offline (HF_HUB_OFFLINE=1) ({text}); unset HF_HUB_OFFLINE, or use a local copy"
    if any(w in low for w in ("credential", "accessdenied", "access denied", "403",
                              "unauthorized", "401", "permission")):
        return (f"no credentials or no access ({text}); set the storage's credentials "
                f"(AWS_*, GOOGLE_APPLICATION_CREDENTIALS, HF_TOKEN) or check the URI")
    if any(w in low for w in ("nosuchbucket", "no such bucket", "bucket does not exist",
                              "404", "not found")):
        return f"no such bucket or path ({text}); check the URI"
    if any(w in low for w in ("resolve", "connect", "network", "timed out", "timeout",
                              "name or service", "unreachable", "offline")):
        return f"offline or unreachable ({text}); check the network, or use a local copy"
    return f"{text}; check the URI, the network and the credentials"


def _saved_datasets(fs: pafs.FileSystem, listed: list[str], hits: list[str]
                    ) -> tuple[list[str], list[list[str]]]:
    """``hits`` where each folder holding a ``state.json`` with ``_data_files`` (written by
    ``datasets``' ``save_to_disk``) keeps only the files it names, and each such folder's
    files in its order."""
    out, ordered = hits, []
    for state in sorted(f for f in listed
                        if f.endswith("state.json") and os.path.basename(f) == "state.json"):
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


def is_local(fs: pafs.FileSystem) -> bool:
    return isinstance(fs, pafs.LocalFileSystem)

