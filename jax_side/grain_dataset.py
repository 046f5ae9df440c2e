"""The host feed as a ``grain.IterDataset``: grain's transformations run on top of it.

``FeedDataset`` is a source ``IterDataset``: each ``iter`` starts a new feed (a
``FeedIterator``) at step 0, and grain's datasets built on it (``map``, ``filter``,
``ThreadPrefetchIterDataset``, ``mp_prefetch``) pass ``get_state``/``set_state`` down to it,
so a state saved from the outermost iterator restores the feed exactly::

    ds = FeedDataset(config, sharding=sharding, host_local=True).map(add_loss_mask)
    it = iter(ds)
    batch = next(it)                  # the feed's batch, through add_loss_mask
    state = it.get_state()            # the feed's state, under grain's keys
    it = iter(ds); it.set_state(state)  # continues after that batch

The feed is one ordered stream per host, and it belongs to this JAX process (its sharding names
this process's devices, the end-of-data agreement runs between the JAX processes): it can
neither be split between grain's prefetch workers nor move into one. ``mp_prefetch`` on top of
it is refused with that explanation; prefetch in a thread instead
(``grain.experimental.ThreadPrefetchIterDataset``, which overlaps ``map`` work that releases the
GIL) and keep the feed's own ``device_prefetch``, whose thread already assembles the batches.
"""

from __future__ import annotations

from typing import Any

import grain
from jax.sharding import NamedSharding

from ingest.config import Config
from jax_side.grain_iter import FeedIterator

__all__ = ["FeedDataset"]

_ONE_PROCESS = (
    "the feed is one ordered stream per host, made in the JAX process whose devices it fills. "
    "Instead of mp_prefetch, prefetch in a thread (grain.experimental.ThreadPrefetchIterDataset) "
    "and raise the feed's own device_prefetch")


class FeedDataset(grain.IterDataset):
    """A source ``grain.IterDataset`` whose iterators are feeds from step 0.

    Args:
      config: the validated config.
      sharding: a ``NamedSharding`` for ``[global_batch_size, seq_len]`` arrays.
      backend: ``ray`` (worker actors; Ray must be initialized) or ``local``.
      host_local: yield this host's rows as numpy arrays (``HostLocalFeed``) instead of global
        ``jax.Array``s.
      **feed_options: further ``HostFeed`` arguments (``workers``, ``plan``,
        ``device_prefetch``, ``get_timeout_s``).
    """

    def __init__(self, config: Config, *, sharding: NamedSharding, backend: str = "ray",
                 host_local: bool = False, **feed_options: Any):
        super().__init__()
        self._config = config
        self._sharding = sharding
        self._backend = backend
        self._host_local = host_local
        self._options = feed_options

    def __iter__(self) -> FeedIterator:
        return FeedIterator(self._config, sharding=self._sharding, backend=self._backend,
                            host_local=self._host_local, **self._options)

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """grain's prefetch workers would take a share of the dataset each: refused.

        Raises:
          ValueError: always, naming what to use instead.
        """
        raise ValueError(f"FeedDataset cannot be split between grain prefetch workers (asked "
                         f"for slice {sl}, sequential_slice={sequential_slice}): {_ONE_PROCESS}")

    def __getstate__(self) -> dict[str, Any]:
        """Refused: a feed runs in the JAX process whose devices it fills.

        Raises:
          TypeError: always (grain's ``mp_prefetch`` pickles its dataset for its workers).
        """
        raise TypeError(f"FeedDataset cannot be pickled into another process: {_ONE_PROCESS}")

    def __str__(self) -> str:
        return (f"FeedDataset(backend={self._backend!r}, host_local={self._host_local}, "
                f"streams={self._config.num_streams})")
