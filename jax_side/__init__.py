"""jax_side: the host feed: owned streams, global-array formation, prefetch, checkpoints."""

from jax_side.eval_feed import EvalFeed
from jax_side.feed import HostFeed, LocalSource
from jax_side.sharding import HostRows, batch_sharding, host_rows

__all__ = ["EvalFeed", "HostFeed", "HostRows", "LocalSource", "batch_sharding", "host_rows"]
