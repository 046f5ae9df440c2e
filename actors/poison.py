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
from actors.placement import Placement
from ingest.config import Config
from ingest.plan.build import UnitPlan
from ingest.stream.chunk import StartAt
from ingest.stream.kinds import open_stream

__all__ = ["PoisonLocator", "describe_position"]

log = logging.getLogger("ingest.pool")


def describe_position(config: Config, plan: UnitPlan, s: int, at: StartAt) -> str:
    """The file and row of stream ``s`` at ``at`` (state, rows to skip), for error messages."""
    state, skip = at
    stream = open_stream(config, plan, s)
    if state is not None:
        stream.set_state(state)
    where = stream.describe_head()
    return where + (f", {skip} rows further" if skip else "")


class PoisonLocator:
    """Locates the document that kills a stream's workers, on a disposable worker.

    Args:
      config: the validated config.
      plan: the unit plan.
      placement: where disposable workers are started from.
      chunk_rows: rows of the traced chunk (the pool's).
      timeout_s: how long a traced chunk may take.

    Attributes:
      poisoned: documents located as killing workers and skipped.
    """

    def __init__(self, config: Config, plan: UnitPlan, placement: Placement, *,
                 chunk_rows: int, timeout_s: float):
        self._config = config
        self._chunk_rows = chunk_rows
        self._plan = plan
        self._placement = placement
        self._timeout = timeout_s
        self.poisoned = 0

    def locate(self, s: int, at: StartAt, failures: int) -> StartAt | None:
        """Runs stream ``s``'s next chunk from ``at`` on a disposable worker that names each
        document before tokenizing it. If that worker dies, the document it named is the
        poison: returns ``at`` with it added to the state (skipped and counted as
        ``worker_crash``). Returns ``at`` itself if the chunk came back (the ``failures`` were
        not this stream's data), and None when the worker died without naming a document (the
        failures cannot be located)."""
        mailbox = Mailbox.remote()
        probe = self._placement.spawn()
        state, skip = at
        log.warning("stream %d failed %d times at %s: locating the document that kills its "
                    "workers (on_bad_document: skip)", s, failures,
                    describe_position(self._config, self._plan, s, at))
        try:
            raise_worker_error(get_within(probe.open.remote(s, state, skip), self._timeout,
                                          f"opening stream {s} to locate a poison document"))
            get_within(probe.produce_traced.remote(s, self._chunk_rows, mailbox),
                       self._timeout, f"a traced chunk of stream {s}")
        except WORKER_LOST:
            raw = get_within(mailbox.get.remote(), self._timeout, "the place a worker died at")
            if raw is None:
                return None
            where = json.loads(raw)
            stream = open_stream(self._config, self._plan, s)
            if state is not None:
                stream.set_state(state)
            stream.add_poison(where)
            self.poisoned += 1
            log.warning("stream %d: skipping the document at %s that killed %d workers "
                        "(counted as worker_crash)", s, where, failures + 1)
            return stream.get_state(), skip
        finally:
            ray.kill(mailbox, no_restart=True)
            self._placement.kill(probe)
        return at
