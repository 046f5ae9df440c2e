"""Locating a poison document: one that kills every worker tokenizing it.

After ``max_failures`` failures of a stream at one position (``actors.recovery``), with
``on_bad_document: skip``, the stream's next chunk runs on a disposable worker that writes
each document's place to a ``Mailbox`` before tokenizing it. If that worker dies too, the last
place written is the poison: it goes into the stream's resume state, so every worker skips it
(counted as ``worker_crash``).
"""

from __future__ import annotations

import json
import logging

import ray

from actors.calls import WORKER_LOST, get_within, raise_worker_error
from actors.mailbox import Mailbox
from ingest.stream import open_stream

__all__ = ["PoisonLocator"]

log = logging.getLogger("ingest.pool")


class PoisonLocator:
    """The poison-document side of ``actors.pool.WorkerPool`` (mixed into it).

    Reads the pool's ``_config``, ``_plan``, ``_timeout``, ``max_failures`` and ``_spawn``;
    changes ``_resume``, ``_failures`` and ``_names``; keeps the count ``poisoned``.
    """

    def _skip_poison(self, s: int) -> bool:
        """Runs stream ``s``'s next chunk on a disposable worker that names each document
        before tokenizing it. If that worker dies, the document it named is the poison: it is
        added to the stream's resume state (skipped and counted as ``worker_crash``). Returns
        False when the worker died without naming a document (the failures cannot be
        located); True otherwise, and the failure count starts over."""
        mailbox = Mailbox.remote()
        probe = self._spawn()
        state, skip = self._resume[s]
        log.warning("stream %d failed %d times at %s: locating the document that kills its "
                    "workers (on_bad_document: skip)", s, self.max_failures, self._where_is(s))
        try:
            raise_worker_error(get_within(probe.open.remote(s, state, skip), self._timeout,
                                          f"opening stream {s} to locate a poison document"))
            get_within(probe.produce_traced.remote(s, self._config.chunk_rows, mailbox),
                       self._timeout, f"a traced chunk of stream {s}")
        except WORKER_LOST:
            raw = get_within(mailbox.get.remote(), self._timeout, "the place a worker died at")
            if raw is None:
                return False
            where = json.loads(raw)
            stream = open_stream(self._config, self._plan, s)
            if state is not None:
                stream.set_state(state)
            stream.add_poison(where)
            self._resume[s] = (stream.get_state(), skip)
            self._failures.pop(s, None)
            self.poisoned += 1
            log.warning("stream %d: skipping the document at %s that killed %d workers "
                        "(counted as worker_crash)", s, where, self.max_failures + 1)
            return True
        finally:
            ray.kill(mailbox, no_restart=True)
            self._names.pop(id(probe), None)
            ray.kill(probe, no_restart=True)
        # The chunk came back: the failures were not this stream's data. Go on retrying.
        self._failures.pop(s, None)
        return True

    def _where_is(self, s: int) -> str:
        """The file and row at stream ``s``'s resume position, for error messages."""
        state, skip = self._resume[s]
        stream = open_stream(self._config, self._plan, s)
        if state is not None:
            stream.set_state(state)
        where = stream.describe_head()
        return where + (f", {skip} rows further" if skip else "")
