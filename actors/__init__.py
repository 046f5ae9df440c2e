"""actors: the Ray side: the worker actor and the pool that places streams on workers, and the
Ray cluster a command runs on (``actors.ray_cluster``)."""

import importlib

__all__ = ["WORKER_ENV", "StreamWorker", "WorkerPool"]

_WHERE = {"WORKER_ENV": "worker", "StreamWorker": "worker", "WorkerPool": "pool"}


def __getattr__(name: str):
    # Imported on first use: ``actors.ray_cluster`` prepares the environment Ray reads at its
    # import (loopback addresses, authentication), so importing the package must not import Ray.
    if name in _WHERE:
        return getattr(importlib.import_module(f"actors.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'actors' has no attribute {name!r}")
