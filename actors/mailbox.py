"""``Mailbox``: one value that outlives the process that wrote it.

A worker tracing the documents it tokenizes (``StreamWorker.produce_traced``) writes each one's
place here before tokenizing it; if a document kills the worker, the host reads which one it was
(``actors.poison`` locating a poison document). A tiny actor of Ray's public API: each write is a
round trip, so the place is stored before the tokenizer runs.
"""

from __future__ import annotations

import ray

__all__ = ["Mailbox"]


@ray.remote(num_cpus=0)
class Mailbox:
    """Holds the last value put, None before any."""

    def __init__(self):
        self._value: str | None = None

    def put(self, value: str) -> None:
        self._value = value

    def get(self) -> str | None:
        return self._value
