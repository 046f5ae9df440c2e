"""The one place the feed uses private JAX and Ray APIs, each with a fallback.

``put_arrays`` puts host arrays on a sharding through ``jax._src.interpreters.pxla.shard_args``,
the batched host-to-device transfer that ``jax.device_put`` ends in. For the six numpy fields
of a batch it took 42 us against 121 us through ``jax.device_put`` (1 CPU device; 148 against
246 on 8 devices), whose pytree, abstraction and primitive-bind layers are Python run on every
call; the feed makes one such call per batch, on the thread that assembles batches. The copy
semantics are ``jax.device_put``'s default (may alias the numpy buffer, no donation), and
tests/test_feed.py checks that both give the same arrays: type, sharding, committed flag,
shards and values.

When this JAX lacks the private function, or its signature differs (a ``TypeError`` on the
first call), ``put_arrays`` uses ``jax.device_put`` from then on.

``cluster_types`` lists the cluster environments ``jax.distributed.initialize()`` probes
(``jax._src.clusters``), so that ``ingest run`` can tell whether it runs in one before joining;
without them it joins only when given ``--coordinator`` or when JAX finds one itself.

``coordination_client`` is JAX's client of the coordination service that
``jax.distributed.initialize`` starts (``jax._src.distributed.global_state.client``): its
key-value store lets a host that timed out waiting for the others name the processes that never
arrived. Without it the error cannot name them.

``ray_auto_address`` resolves ``--address=auto`` the way ``ray.init`` does, so that a dead
cluster is reported in seconds; without it the address goes to ``ray.init`` unchecked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

__all__ = ["batched_transfer", "cluster_types", "coordination_client", "put_arrays",
           "ray_auto_address"]

log = logging.getLogger(__name__)


def _find_shard_args() -> Callable[[list[np.ndarray], Sharding], list[jax.Array]] | None:
    """JAX's batched host-to-device transfer, or None if this JAX has no such function."""
    try:
        from jax._src.interpreters import pxla  # noqa: PLC0415
        from jax._src.lib import xla_client  # noqa: PLC0415

        reuse = xla_client.ArrayCopySemantics.REUSE_INPUT  # device_put's default
        shard_args = pxla.shard_args
    except (ImportError, AttributeError):
        return None

    def put(arrays: list[np.ndarray], sharding: Sharding) -> list[jax.Array]:
        n = len(arrays)
        return shard_args([sharding] * n, [None] * n, [reuse] * n, arrays)

    return put


_shard_args = _find_shard_args()


def batched_transfer() -> bool:
    """Whether ``put_arrays`` uses JAX's private batched transfer (else ``jax.device_put``)."""
    return _shard_args is not None


def put_arrays(arrays: Sequence[np.ndarray], sharding: Sharding) -> list[jax.Array]:
    """Each of ``arrays`` (the whole of each, on this process) as a ``jax.Array`` on
    ``sharding``: what ``jax.device_put(list(arrays), sharding)`` gives, faster."""
    global _shard_args  # noqa: PLW0603 -- dropped once if this JAX's signature differs
    if _shard_args is not None:
        try:
            return _shard_args(list(arrays), sharding)
        except TypeError as e:  # another signature in another JAX: the public call from here on
            log.warning("jax's pxla.shard_args failed (%s); using jax.device_put", e)
            _shard_args = None
    return jax.device_put(list(arrays), sharding)


def cluster_types() -> list[type]:
    """The cluster environment classes ``jax.distributed.initialize()`` probes (Cloud TPU,
    Kubernetes, SLURM, Open MPI, ...), in its order.

    Raises:
      ImportError, AttributeError: this JAX keeps them elsewhere.
    """
    from jax._src import clusters  # noqa: PLC0415

    return list(clusters.ClusterEnv._cluster_types)


def coordination_client() -> Any | None:
    """JAX's client of the coordination service (``key_value_set``, ``key_value_dir_get``,
    ``key_value_delete``), or None when this process joined none or this JAX keeps it
    elsewhere."""
    try:
        from jax._src import distributed  # noqa: PLC0415
    except ImportError:
        return None
    return getattr(getattr(distributed, "global_state", None), "client", None)


def ray_auto_address() -> str | None:
    """The cluster ``ray.init(address="auto")`` would join: the last ``ray start`` on this
    machine (Ray's ``ray_current_cluster`` file), else a GCS process running here; None when
    this Ray keeps that lookup elsewhere.

    Raises:
      ConnectionError: no cluster is found (Ray's own error).
    """
    try:
        from ray._private.services import get_ray_address_from_environment  # noqa: PLC0415
    except ImportError:
        return None
    return get_ray_address_from_environment("auto", None)
