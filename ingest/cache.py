"""This machine's cache folder for derived files: the demo corpus, parsed tokenizer vocabularies,
the plan's file metadata.

Everything here can be rebuilt from its inputs; a cache that cannot be read or written is
skipped, never an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import tempfile
import time
from collections.abc import Callable
from typing import Any

__all__ = ["cache_root", "cached_by_files", "made_once", "read_entries", "write_entries",
           "write_atomically"]

log = logging.getLogger("ingest.cache")


def cache_root() -> str:
    """``$INGEST_CACHE_DIR``, else ``$XDG_CACHE_HOME/ingest``, else ``~/.cache/ingest``."""
    return os.environ.get("INGEST_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ingest")


def cached_by_files(kind: str, files: list[str], build: Callable[[], Any], *,
                    what: str | None = None) -> Any:
    """``build()``, pickled under the cache folder and reused while ``files`` keep their
    paths, sizes and modification times. ``what`` names the value in the line logged when
    it is built (``made_once``).

    For values that take long to derive from small files (GPT-2's BPE ranks), read once by
    every worker process of every run.
    """
    try:
        stats = [(os.path.abspath(f), st.st_size, st.st_mtime_ns)
                 for f, st in ((f, os.stat(f)) for f in files)]
    except OSError:
        return build()
    key = hashlib.sha256(repr((kind, stats)).encode()).hexdigest()[:16]
    path = os.path.join(cache_root(), kind, f"{key}.pkl")
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        pass
    except Exception as e:  # noqa: BLE001 -- a damaged cache file is rebuilt
        log.warning("ignoring the unreadable cache file %s (%s: %s)", path, type(e).__name__, e)
    t0 = time.perf_counter()
    value = build()

    def dump(tmp: str) -> None:
        with open(tmp, "wb") as f:
            pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)

    with contextlib.suppress(OSError), made_once(what or kind, os.path.dirname(path), since=t0):
        write_atomically(path, dump)
    return value


def _entries_path(kind: str, name: str) -> str:
    return os.path.join(cache_root(), kind, f"{name}.pkl")


def read_entries(kind: str, name: str) -> dict:
    """The dict last kept by ``write_entries(kind, name, ...)``; empty if there is none (a
    damaged one is ignored with a warning). The caller checks that each entry still holds."""
    path = _entries_path(kind, name)
    try:
        with open(path, "rb") as f:
            out = pickle.load(f)
    except FileNotFoundError:
        return {}
    except Exception as e:  # noqa: BLE001 -- a damaged cache file is rebuilt
        log.warning("ignoring the unreadable cache file %s (%s: %s)", path, type(e).__name__, e)
        return {}
    return out if isinstance(out, dict) else {}


def write_entries(kind: str, name: str, entries: dict) -> str | None:
    """Keeps ``entries`` for ``read_entries`` (replacing what was kept, atomically: processes
    that write at once leave one whole dict); returns where, or None where the cache folder
    cannot be written."""
    path = _entries_path(kind, name)

    def dump(tmp: str) -> None:
        with open(tmp, "wb") as f:
            pickle.dump(entries, f, protocol=pickle.HIGHEST_PROTOCOL)

    try:
        write_atomically(path, dump)
    except OSError as e:
        log.info("cannot keep %s for later runs (%s)", path, e)
        return None
    return path


@contextlib.contextmanager
def made_once(what: str, where: str, since: float | None = None):
    """Logs, once the block has written ``what`` to ``where`` for later runs to read, how long
    making it took (from ``since``, a ``time.perf_counter()``, else the block's start): a
    first run on a machine is slower by these, and says why. A block that raises logs
    nothing."""
    t0 = time.perf_counter() if since is None else since
    yield
    log.info("%s: made in %.1f s, kept in %s for later runs", what, time.perf_counter() - t0,
             where)


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """Makes ``path`` by ``write(tmp)`` to a temporary file beside it, then a rename: other
    processes see the whole file or none. Raises OSError (the temporary file removed)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
