"""The one place the feed uses private JAX and Ray APIs, each with a fallback.

``put_arrays`` puts host arrays on a sharding through JAX's batched host-to-device transfer
(``jax._src.lib.xla_client.batched_device_put``), the call that ``jax.device_put`` and
``jax.make_array_from_process_local_data`` end in. What those work out again on every call
(the abstract value, the devices, each device's slice of the array) depends only on the
shapes, dtype and sharding, so ``put_arrays`` takes it once per such key from one public call,
checks its own first array against that call's, and keeps it. For the six ``[32, 1024]`` int32
fields of a batch on 1 CPU device this took 75 us of CPU against 245 us through
``pxla.shard_args``, 600 us through ``jax.device_put`` and 1.1 ms through
``make_array_from_process_local_data`` (1.5 ms on 8 devices), whose pytree, abstraction and
primitive-bind layers are Python run on every call; the feed makes one such call per batch,
on the thread that assembles batches. The copy semantics are the public calls' (may alias the
numpy buffer, no donation), and tests/test_feed.py and tests/test_multihost.py check that both
give the same arrays: type, abstract value, sharding, committed flag, shards and values. Arrays
whose dtype JAX would convert (int64 without x64) go through the public call, and so does a
key whose first fast array differs from the public call's (with a warning).

When this JAX lacks the private function, or its signature differs (a ``TypeError`` on the
first call), ``put_arrays`` uses the public calls from then on.

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


def _find_batched_put() -> Callable[..., list[jax.Array]] | None:
    """JAX's batched host-to-device transfer with its per-shape work kept, or None if this
    JAX has no such function."""
    try:
        from jax._src.lib import xla_client  # noqa: PLC0415

        return _planned_put(xla_client.batched_device_put)
    except (ImportError, AttributeError):
        return None


def _planned_put(batched_device_put: Callable[..., jax.Array]) -> Callable[..., list[jax.Array]]:
    """``put_arrays``' transfer through ``batched_device_put(aval, sharding, shards, devices,
    committed)``, with each shape's plan kept."""
    # (shape, dtype, sharding, global shape) -> (abstract value, devices, each device's index
    # into the array, None where each holds all of it), or None where the public call is
    # used. A feed puts one shape on one sharding.
    plans: dict[tuple, tuple | None] = {}

    def transfer(x: np.ndarray, sharding: Sharding, p: tuple) -> jax.Array:
        aval, devices, indices = p
        shards = [x] * len(devices) if indices is None else [x[i] for i in indices]
        return batched_device_put(aval, sharding, shards, devices, True)

    def plan(x: np.ndarray, sharding: Sharding, global_shape: tuple[int, ...] | None,
             ref: jax.Array) -> tuple | None:
        # The abstract value as the public call makes it (with the sharding's spec and memory
        # space), and each device's slice of this process's rows as
        # make_array_from_process_local_data finds it: along a dimension the process holds
        # part of, its devices' slices in the order of their global starts.
        if ref.dtype != x.dtype:
            return None
        shape = x.shape if global_shape is None else global_shape
        where = sharding.addressable_devices_indices_map(shape)
        shard_shape = sharding.shard_shape(shape)
        starts = [sorted({idx[d].start or 0 for idx in where.values()})
                  for d in range(len(shape))]

        def local(d: int, slc: slice) -> slice:
            if x.shape[d] == shape[d]:
                return slc
            k = starts[d].index(slc.start or 0)
            return slice(k * shard_shape[d], (k + 1) * shard_shape[d])

        indices = tuple(tuple(local(d, slc) for d, slc in enumerate(idx))
                        for idx in where.values())
        whole = (slice(None),) * x.ndim
        p = ref.aval, list(where), None if all(i == whole for i in indices) else indices
        if not _same_array(transfer(x, sharding, p), ref):
            log.warning("jax's batched_device_put gave another array than its public call "
                        "for %s %s; using the public call for it", x.dtype, x.shape)
            return None
        return p

    def put(arrays: list[np.ndarray], sharding: Sharding,
            global_shape: tuple[int, ...] | None = None) -> list[jax.Array]:
        if global_shape is not None:
            global_shape = tuple(global_shape)
        out = []
        for x in arrays:
            key = (x.shape, x.dtype, sharding, global_shape)
            p = plans.get(key, plans)
            if p is plans:  # not planned yet: the public call, which the plan is checked on
                if len(plans) >= 64:
                    plans.clear()
                ref = _public_put(x, sharding, global_shape)
                plans[key] = plan(x, sharding, global_shape, ref)
                out.append(ref)
            else:
                out.append(_public_put(x, sharding, global_shape) if p is None
                           else transfer(x, sharding, p))
        return out

    return put


def _public_put(x: np.ndarray, sharding: Sharding,
                global_shape: tuple[int, ...] | None) -> jax.Array:
    """The public call ``put_arrays`` equals for one array."""
    if global_shape is None:
        return jax.device_put(x, sharding)
    return jax.make_array_from_process_local_data(sharding, x, global_shape)


def _same_array(a: jax.Array, b: jax.Array) -> bool:
    """Same abstract value, sharding, and this process's shards (device, index, values)."""
    if a.aval != b.aval or a.sharding != b.sharding:
        return False
    sa, sb = a.addressable_shards, b.addressable_shards
    return len(sa) == len(sb) and all(
        x.device == y.device and x.index == y.index
        and np.array_equal(np.asarray(x.data), np.asarray(y.data))
        for x, y in zip(sa, sb, strict=True))


_batched_put = _find_batched_put()


def batched_transfer() -> bool:
    """Whether ``put_arrays`` uses JAX's private batched transfer (else the public calls)."""
    return _batched_put is not None


def put_arrays(arrays: Sequence[np.ndarray], sharding: Sharding,
               global_shape: tuple[int, ...] | None = None) -> list[jax.Array]:
    """Each of ``arrays`` as a ``jax.Array`` on ``sharding``, faster than the public calls
    it equals: ``jax.device_put(x, sharding)`` for each (each array whole, on this process),
    or with ``global_shape``, ``jax.make_array_from_process_local_data(sharding, x,
    global_shape)`` (each array this process's part of the global one)."""
    global _batched_put  # noqa: PLW0603 -- dropped once if this JAX's signature differs
    if _batched_put is not None:
        try:
            return _batched_put(list(arrays), sharding, global_shape)
        except TypeError as e:  # another signature in another JAX: the public call from here on
            log.warning("jax's batched_device_put failed (%s); using its public call", e)
            _batched_put = None
    return [_public_put(x, sharding, global_shape) for x in arrays]


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
