"""The host feed as a ``grain.DatasetIterator``: grain's checkpointing and loops run on it.

A training loop written for grain's iterators, and grain's orbax handler, work unchanged::

    it = FeedIterator(config, sharding=sharding)            # a grain.DatasetIterator
    manager = ocp.CheckpointManager(directory)
    for step, batch in enumerate(it, start=1):
        state = train_step(state, batch)
        if step % 1000 == 0:
            manager.save(step, args=ocp.args.Composite(
                model=ocp.args.StandardSave(state),
                data=grain.checkpoint.CheckpointSave(it)))
    ...
    it = FeedIterator(config, sharding=sharding)
    manager.restore(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(it)))

grain's handler writes each process's ``get_state()`` as ``process_{i}-of-{n}.json`` and
restores each process from its own file, so a restore through it needs the same number of JAX
processes; ``jax_side.checkpoint`` merges every process file and restores on any count.
"""

from __future__ import annotations

import copy
from typing import Any

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from ingest.config import Config
from jax_side.feed import HostFeed
from jax_side.host_local import HostLocalFeed

__all__ = ["FeedIterator"]


class FeedIterator(grain.DatasetIterator):
    """A ``HostFeed`` behind grain's iterator interface: ``next``, ``get_state``,
    ``set_state``, ``close``.

    ``set_state`` may be called at any point, as grain allows: once batches were taken, the
    feed is closed and a fresh one (same config, sharding, backend and plan) starts from the
    state. Its statistics (``feed.stats()``) then count from there.

    Args:
      config: the validated config.
      sharding: a ``NamedSharding`` for ``[global_batch_size, seq_len]`` arrays.
      backend: ``ray`` (worker actors; Ray must be initialized) or ``local``.
      host_local: yield this host's rows as numpy arrays (``HostLocalFeed``) instead of
        global ``jax.Array``s, for stacks that form the global arrays themselves.
      **feed_options: further ``HostFeed`` arguments (``workers``, ``plan``,
        ``device_prefetch``, ``get_timeout_s``).
    """

    def __init__(self, config: Config, *, sharding: NamedSharding, backend: str = "ray",
                 host_local: bool = False, **feed_options: Any):
        super().__init__()
        self._feed_class = HostLocalFeed if host_local else HostFeed
        self._feed = self._feed_class(config, sharding=sharding, backend=backend,
                                      **feed_options)
        # Later feeds reuse the plan: no second listing of the corpus on set_state.
        self._options = {**feed_options, "plan": self._feed.plan}
        self._taken = False
        self._ended = False

    @property
    def feed(self) -> HostFeed:
        """The ``HostFeed`` underneath (statistics, ``resize``, ``iterator_length``)."""
        return self._feed

    def __iter__(self) -> FeedIterator:
        iter(self._feed)  # reset_after_epoch: a new loop over a finished pass restarts it
        return self

    def __next__(self) -> dict[str, jax.Array] | dict[str, np.ndarray]:
        self._check_open()
        self._taken = True
        return next(self._feed)

    def get_state(self) -> dict[str, Any]:
        """The state after the last batch returned: the ``HostFeed`` state, plain JSON."""
        return copy.deepcopy(self._feed.get_state())

    def set_state(self, state: dict[str, Any]) -> None:
        """Continues from ``state`` (from ``get_state`` of this or an earlier run).

        Raises:
          ValueError: the state was saved under another config or corpus (naming the
            difference), or lacks a stream this process owns.
        """
        self._check_open()
        if self._taken:
            old = self._feed
            self._feed = self._feed_class(old.config, sharding=old.sharding,
                                          backend=old.backend, **self._options)
            old.close()
            self._taken = False
        self._feed.set_state(state)

    def close(self) -> None:
        """Stops the feed's producer thread and its workers (idempotent)."""
        feed = getattr(self, "_feed", None)  # grain's __del__ calls this, even after a failed init
        if feed is not None and not getattr(self, "_ended", False):
            feed.close()
        self._ended = True
        super().close()

    def _check_open(self) -> None:
        if self._ended:
            raise ValueError(f"Trying to advance a closed iterator: '{self}'.")

    def __str__(self) -> str:
        return f"FeedIterator(backend={self._feed.backend!r}, streams={list(self._feed.streams)})"
