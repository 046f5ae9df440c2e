"""Large decoded row groups, kept on this machine's disk so that each unit reads only its rows.

A unit is often a part of a Parquet row group (``unit_rows`` below the group's rows), and
Parquet decodes a column a whole row group at a time. Small groups stay decoded in memory
(``ingest.sources.files``); a group too large for that cache would be decoded again for every unit of
it, for a cost that grows with the square of the group's size (pandas and ``pq.write_table``
put up to a million rows in a group). Here such a group is decoded once per machine, written
uncompressed as an Arrow IPC file under the cache folder, and memory-mapped: a unit then
copies only its own rows, in every worker process on the machine, every epoch and every run.
The same holds for a large compressed IPC record batch; a compressed JSON Lines file is kept
here decompressed, so that each of its groups of lines is read by a seek.

The files take the decoded text's size on disk, at most ``$INGEST_ROW_GROUP_CACHE_GB`` GiB
(default 16; 0 turns this off) in all: the least recently used go first. Like every cache here,
one that cannot be written or read is skipped (the group is decoded in memory instead),
never an error.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.ipc as ipc

from ingest.cache import cache_root, write_atomically

__all__ = ["budget_bytes", "exclusive", "folder", "load_spilled", "spill"]

log = logging.getLogger("ingest.sources.spill")

DEFAULT_BUDGET_GB = 16.0
_SUFFIX = ".arrow"
_warned: set[str] = set()


def budget_bytes() -> int:
    """The disk budget for spilled row groups, from ``$INGEST_ROW_GROUP_CACHE_GB``."""
    raw = os.environ.get("INGEST_ROW_GROUP_CACHE_GB", "")
    try:
        gb = float(raw) if raw.strip() else DEFAULT_BUDGET_GB
    except ValueError:
        raise ValueError(f"INGEST_ROW_GROUP_CACHE_GB={raw!r} is not a number; set it to the "
                         f"GiB of disk for decoded row groups (0 turns the cache off)") from None
    return max(0, int(gb * 2**30))


def folder() -> str:
    """Where spilled row groups go: ``row-groups`` under the cache folder."""
    return os.path.join(cache_root(), "row-groups")


def _path(key: tuple) -> str:
    return os.path.join(folder(), hashlib.sha256(repr(key).encode()).hexdigest()[:32] + _SUFFIX)


def load_spilled(key: tuple, rows: int) -> pa.Table | None:
    """The spilled table for ``key`` (any picklable tuple naming file, group and column),
    memory-mapped; None if there is none or it is not ``rows`` rows (then it is removed)."""
    path = _path(key)
    try:
        source = pa.memory_map(path, "r")
    except (FileNotFoundError, pa.ArrowIOError, OSError):
        return None
    try:
        table = ipc.open_file(source).read_all()  # zero-copy: the arrays point into the map
        if table.num_rows != rows:
            raise ValueError(f"{table.num_rows} rows; expected {rows}")
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError, ValueError) as e:
        log.warning("removing the damaged row-group cache file %s (%s: %s)", path,
                    type(e).__name__, e)
        with contextlib.suppress(OSError):
            os.unlink(path)
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # recently used: evicted last
    return table


def spill(key: tuple, table: pa.Table) -> pa.Table | None:
    """Writes ``table`` for ``key`` and returns it memory-mapped from disk; None when the
    cache is off, or the table is over half the budget, or the folder cannot be written."""
    budget = budget_bytes()
    if budget == 0 or table.nbytes > budget // 2:
        return None
    where, path = folder(), _path(key)

    def write(tmp: str) -> None:
        with pa.OSFile(tmp, "wb") as f, ipc.new_file(f, table.schema) as writer:
            writer.write_table(table)

    try:
        os.makedirs(where, exist_ok=True)
        _evict(where, budget - table.nbytes, keep=path)
        write_atomically(path, write)  # concurrent workers never map a partial file
    except OSError as e:
        if where not in _warned:
            _warned.add(where)
            log.warning("cannot keep decoded row groups under %s (%s: %s): large row groups "
                        "are decoded again for each unit of them; set INGEST_CACHE_DIR to a "
                        "writable folder with space", where, type(e).__name__, e)
        return None
    return load_spilled(key, table.num_rows)


def decompressed_copy(key: tuple, nbytes: int, write) -> str | None:
    """The path of a decompressed copy of a compressed file (``key`` names it, ``nbytes`` is
    its decompressed size), written by ``write(tmp_path)`` once per machine (the other
    processes wait for it, as for a decoded group): a compressed stream cannot seek, and the
    copy lets each group be read by a seek. None when the cache is off, the copy would be over
    half the budget, or the folder cannot be written (the caller decompresses instead)."""
    budget = budget_bytes()
    if budget == 0 or nbytes > budget // 2:
        return None
    where, path = folder(), _path(key)
    with exclusive(key, nbytes):
        with contextlib.suppress(OSError):
            if os.path.getsize(path) == nbytes:
                os.utime(path)  # recently used: evicted last
                return path
        try:
            os.makedirs(where, exist_ok=True)
            _evict(where, budget - nbytes, keep=path)
            write_atomically(path, write)
        except OSError as e:
            if where not in _warned:
                _warned.add(where)
                log.warning("cannot keep decompressed copies under %s (%s: %s): each group of "
                            "a compressed JSONL file is read by decompressing from the file's "
                            "start; set INGEST_CACHE_DIR to a writable folder with space",
                            where, type(e).__name__, e)
            return None
    return path


def adopt_copy(key: tuple, tmp: str, nbytes: int) -> str | None:
    """Moves ``tmp``, a decompressed copy of ``nbytes`` written beside the cache folder's
    files, to where ``decompressed_copy`` finds it for ``key``; deletes it and returns None
    when it is over half the budget."""
    budget = budget_bytes()
    path = _path(key)
    try:
        if budget == 0 or nbytes > budget // 2:
            os.unlink(tmp)
            return None
        _evict(folder(), budget - nbytes, keep=path)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return None
    return path


@contextlib.contextmanager
def exclusive(key: tuple, nbytes: int, *, wait_s: float = 600.0) -> Iterator[None]:
    """Held while this process decodes the group for ``key`` (``nbytes`` of text, as the plan
    estimates): another process of the machine that needs it meanwhile waits, then maps the
    copy written here, rather than decoding it too. Workers that start on one large file at
    once would each hold a decoded copy in memory. An ``flock`` on a file under ``locks/`` in
    the cache folder, released when the holder exits, however it ends. Without a copy to wait
    for (the cache off, or the group over half the budget), or a lock file, or past
    ``wait_s``: no lock, decode anyway."""
    fd = None
    budget = budget_bytes()
    if budget and nbytes <= budget // 2:
        locks = os.path.join(cache_root(), "locks")  # not in folder(): only copies there
        with contextlib.suppress(OSError):
            os.makedirs(locks, exist_ok=True)
            name = os.path.basename(_path(key))[:-len(_SUFFIX)] + ".lock"
            fd = os.open(os.path.join(locks, name), os.O_CREAT | os.O_RDWR, 0o644)
    locked = False
    deadline = time.monotonic() + wait_s
    while fd is not None and not locked:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            if time.monotonic() > deadline:
                log.warning("another process has decoded a large row group for over %.0f s; "
                            "decoding it here too (%s)", wait_s, key[0])
                break
            time.sleep(0.02)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _evict(folder: str, allowed: int, *, keep: str) -> None:
    """Removes the least recently used files of ``folder`` until at most ``allowed`` bytes
    remain (``keep`` stays). Another process's map of a removed file stays valid."""
    entries = []
    with os.scandir(folder) as it:
        for e in it:
            if e.name.endswith(_SUFFIX) and e.path != keep:
                with contextlib.suppress(OSError):
                    st = e.stat()
                    entries.append((st.st_mtime, st.st_size, e.path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= allowed:
            break
        with contextlib.suppress(OSError):
            os.unlink(path)
            total -= size
