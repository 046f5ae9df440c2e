"""One job per directory: an advisory lock the kernel drops when its holder dies.

``ingest materialize`` holds it on its output directory and ``ingest run`` on its checkpoint
directory. The lock file (``.lock``) names its holder, so a second job is told which
process is in its way::

    with exclusive("ckpt", job="ingest run", fix="choose another --checkpoint-dir"):
        ...   # a second `ingest run` on ckpt fails: "... held by host h1, pid 4242 ..."
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator

__all__ = ["LOCK_FILE", "DirectoryInUseError", "exclusive"]

LOCK_FILE = ".lock"


class DirectoryInUseError(ValueError):
    """Another live process holds the directory's lock.

    Attributes:
      holder: ``host H, pid P`` as the holder wrote it (empty if it wrote nothing yet).
    """

    def __init__(self, message: str, holder: str):
        super().__init__(message)
        self.holder = holder


@contextlib.contextmanager
def exclusive(root: str, *, job: str, fix: str) -> Iterator[None]:
    """Holds ``root/.lock`` (``flock``, exclusive, non-blocking) while the block runs.

    Args:
      root: an existing local directory.
      job: what holds the lock, for the error (``ingest run``).
      fix: what the user can do instead, for the error.

    Raises:
      DirectoryInUseError: another process holds it (naming its host and pid).
    """
    with open(os.path.join(root, LOCK_FILE), "a+", encoding="utf-8") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            f.seek(0)
            holder = f.read().strip()
            raise DirectoryInUseError(
                f"another `{job}` is using {root} ({holder or 'holder not known yet'}); wait "
                f"for it to finish or {fix}", holder) from e
        # Truncated only once held: a waiting process reads the holder's name intact.
        f.seek(0)
        f.truncate()
        f.write(f"host {socket.gethostname()}, pid {os.getpid()}\n")
        f.flush()
        yield
