"""Recovery: replacing a dead worker and reopening its streams where the host last received
them.

When a worker dies (or a call on it fails unexpectedly), the pool replaces it and reopens each
of its streams from the ``state_after`` of the last chunk received for that stream; requests
still in flight are issued again. Streams are deterministic, so no row is lost or repeated.
A stream that keeps failing at the same position stops the run with an error naming it, or,
with ``on_bad_document: skip``, has the document that kills its workers located and skipped
(``actors.poison``).
"""

from __future__ import annotations

import json
import logging

import ray

from actors import orphans
from actors.calls import WORKER_LOST, get_within, raise_worker_error
from ingest.errors import StreamError

__all__ = ["WorkerRecovery"]

log = logging.getLogger("ingest.pool")


class WorkerRecovery:
    """The recovery side of ``actors.pool.WorkerPool`` (mixed into it).

    Reads the pool's ``_config``, ``_timeout``, ``_exhausted``, ``_where``, ``_spawn``,
    ``_fill`` and ``_rehome``; changes ``_workers``, ``_pending``, ``_placement``, ``_queues``
    and ``_solo``; keeps ``_resume`` (stream
    -> where to reopen it: ``(state, rows to skip)``), ``_failures`` (stream -> ``(position,
    count)``), ``max_failures`` and the count ``restarts``.
    """

    def _replace(self, dead, s: int, cause: BaseException) -> None:
        """Replaces worker ``dead`` (which failed serving stream ``s``) and reopens its streams
        where the host last received them. A replacement that dies too is replaced again,
        within the same budget of failures without progress."""
        while True:
            self._count_failure(s, cause)
            log.warning("worker for stream %d failed (%s: %s); replacing it and reopening its "
                        "streams from the last chunk received", s, type(cause).__name__,
                        str(cause).splitlines()[0] if str(cause) else "")
            i = next((i for i, w in enumerate(self._workers) if w is dead), None)
            if i is None:
                return  # Already replaced while serving another of its streams.
            try:
                ray.kill(dead, no_restart=True)
            except Exception:  # noqa: BLE001 -- it may be gone already
                pass
            fresh = self._spawn()
            self.restarts += 1
            self.metrics.restarts.inc()
            moved = [t for t, w in self._placement.items() if w is dead]
            self._solo.update(moved)
            if not orphans.started(self._where[id(fresh)], orphans.REPLACEMENT_START_S):
                # No CPU for it (a lost node took it): it waits as a pending worker.
                del self._workers[i]
                self._pending.append(fresh)
                self._rehome(moved)
                return
            self._workers[i] = fresh
            for t in moved:
                self._placement[t] = fresh
                self._queues[t].clear()
            refs = [fresh.open.remote(t, *self._resume[t]) for t in moved]
            try:
                outs = get_within(refs, self._timeout,
                                  f"reopening streams {moved} on a new worker")
            except WORKER_LOST as e:
                dead, cause = fresh, e
                continue
            for out in outs:
                raise_worker_error(out)
            for t in moved:
                if t not in self._exhausted:
                    self._fill(t)
            return

    def _count_failure(self, s: int, cause: BaseException) -> None:
        """Counts failures of stream ``s`` at its current position; too many stop the run,
        unless ``on_bad_document: skip`` and the failures are a document that kills its
        worker, which is then located and skipped."""
        position = json.dumps(self._resume[s], sort_keys=True)
        last, count = self._failures.get(s, (None, 0))
        count = count + 1 if last == position else 1
        self._failures[s] = (position, count)
        if count >= self.max_failures and self._config.on_bad_document == "skip":
            if self._skip_poison(s):
                return
        if count >= self.max_failures:
            raise StreamError(
                f"stream {s} failed {count} times in a row at {self._where_is(s)} without "
                f"delivering a chunk (a poison document there, or workers lost faster than they "
                f"restart); last error: {type(cause).__name__}: {cause}", stream_id=s) from cause
