"""Which rows of a global batch land on this host, and which streams it therefore owns.

Ownership is read off the batch sharding's addressable indices, never from ``process_index``
arithmetic: with k = B / S rows per stream, global rows ``[s*k, (s+1)*k)`` come from stream s,
and host h owns s when all of those rows land on h's devices::

    B=8, S=4, k=2      rows 0 1 | 2 3 | 4 5 | 6 7      streams 0 | 1 | 2 | 3
    2 hosts            host 0: rows 0-3 -> streams 0, 1    host 1: rows 4-7 -> streams 2, 3
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["HostRows", "batch_sharding", "host_rows"]


@dataclasses.dataclass(frozen=True)
class HostRows:
    """This process's block of global rows and the streams that fill it.

    Attributes:
      start, stop: the process's rows ``[start, stop)`` of the global batch.
      streams: owned stream ids, in row order.
    """

    start: int
    stop: int
    streams: tuple[int, ...]


def batch_sharding(mesh: jax.sharding.Mesh, batch_axes: tuple[str, ...] | str = "data",
                   seq_axis: str | None = None) -> NamedSharding:
    """A ``NamedSharding`` with rows split over ``batch_axes`` (and tokens over ``seq_axis``)."""
    return NamedSharding(mesh, PartitionSpec(batch_axes, seq_axis))


def host_rows(sharding: NamedSharding, global_batch_size: int, seq_len: int,
              num_streams: int) -> HostRows:
    """Checks the sharding against the batch shape and derives this host's rows and streams.

    Raises:
      ValueError: a mesh axis does not divide its dimension, this host's rows are not one
        contiguous block, or a stream's rows would straddle two hosts (naming the fix).
    """
    shape = (global_batch_size, seq_len)
    spec = sharding.spec
    mesh = sharding.mesh
    problems = []
    for dim, (name, size) in enumerate(zip(("global_batch_size", "seq_len"), shape, strict=True)):
        axes = spec[dim] if dim < len(spec) else None
        if axes is None:
            continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        n = 1
        for a in axes:
            n *= mesh.shape[a]
        if size % n:
            problems.append(f"{name}={size} is not divisible by the {n} shards of mesh axes "
                            f"{axes} (mesh {dict(mesh.shape)}); change {name} or the mesh")
    if problems:
        raise ValueError("the batch sharding does not fit the batch: " + "; ".join(problems))
    index_map = sharding.addressable_devices_indices_map(shape)
    row_ranges = sorted({(idx[0].start or 0, idx[0].stop if idx[0].stop is not None else
                          global_batch_size) for idx in index_map.values()})
    start, stop = row_ranges[0][0], row_ranges[-1][1]
    rows = set()
    for a, b in row_ranges:
        rows.update(range(a, b))
    if rows != set(range(start, stop)):
        raise ValueError(
            f"this process's devices hold global rows {row_ranges}, not one contiguous block; "
            f"order the mesh so each process's devices are consecutive along the batch axes "
            f"{spec[0]!r} (e.g. jax.make_mesh puts a process's devices together)")
    k = global_batch_size // num_streams
    if start % k or stop % k:
        raise ValueError(
            f"with num_streams={num_streams}, each stream fills {k} consecutive rows, but this "
            f"process ({jax.process_index()} of {jax.process_count()}) holds rows "
            f"[{start}, {stop}) of global_batch_size={global_batch_size} on mesh "
            f"{dict(mesh.shape)} with rows split over {spec[0]!r}: a stream would straddle two "
            f"hosts. Choose num_streams so that global_batch_size / num_streams divides the "
            f"{stop - start} rows per process (e.g. "
            f"num_streams={global_batch_size // math.gcd(k, stop - start)}), or a mesh that gives "
            f"each process a multiple of {k} rows")
    return HostRows(start, stop, tuple(range(start // k, stop // k)))
