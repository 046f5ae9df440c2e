"""jax_side: the host feed: owned streams, global-array formation, prefetch, checkpoints."""

import importlib

__all__ = ["EvalFeed", "FeedDataset", "FeedIterator", "HostFeed", "HostLocalFeed", "HostRows",
           "LocalSource", "batch_sharding", "host_rows"]

_WHERE = {"EvalFeed": "eval_feed", "FeedDataset": "grain_dataset", "FeedIterator": "grain_iter",
          "HostFeed": "feed", "HostLocalFeed": "host_local",
          "LocalSource": "chunk_intake",
          "HostRows": "sharding", "batch_sharding": "sharding", "host_rows": "sharding"}


def __getattr__(name: str):
    # Imported on first use, so that ``ingest run`` can start Ray before JAX is imported.
    if name in _WHERE:
        return getattr(importlib.import_module(f"jax_side.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'jax_side' has no attribute {name!r}")
