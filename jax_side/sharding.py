"""Which rows of a global batch land on this host, and which streams it therefore owns.

Ownership is read off the batch sharding's addressable indices, never from ``process_index``
arithmetic: with k = B / S rows per stream, global rows ``[s*k, (s+1)*k)`` come from stream s,
and host h owns s when all of those rows land on h's devices::

    B=8, S=4, k=2      rows 0 1 | 2 3 | 4 5 | 6 7      streams 0 | 1 | 2 | 3
    2 hosts            host 0: rows 0-3 -> streams 0, 1    host 1: rows 4-7 -> streams 2, 3

With a batch ramp-up the batch size changes between steps (B_t rows, k_t = B_t / S): each size
has its own block of rows per host, and every size must give a host the same streams::

    B_t=4, k_t=1       rows 0 | 1 | 2 | 3                  host 0: rows 0-1 -> streams 0, 1
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["HostRows", "batch_sharding", "host_rows", "host_rows_per_batch_size"]


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


def host_rows_per_batch_size(sharding: NamedSharding, batch_sizes: dict[int, str], seq_len: int,
                             num_streams: int) -> dict[int, HostRows]:
    """`host_rows` for every global batch size a run uses (``Config.batch_sizes()``).

    Args:
      batch_sizes: each size, with where it comes from (named in errors).

    Raises:
      ValueError: a size does not fit the sharding (naming the size's origin), or two sizes
        would give this host different streams (its streams' rows must stay on its devices).
    """
    out: dict[int, HostRows] = {}
    for size, origin in batch_sizes.items():
        try:
            out[size] = host_rows(sharding, size, seq_len, num_streams)
        except ValueError as e:
            raise ValueError(f"{origin}: {e}") from e
    by_streams = {rows.streams: size for size, rows in out.items()}
    if len(by_streams) > 1:
        detail = "; ".join(f"{batch_sizes[size]} gives streams {list(streams)}"
                           for streams, size in by_streams.items())
        raise ValueError(
            f"process {jax.process_index()} of {jax.process_count()} would own different streams "
            f"at different batch sizes ({detail}); a stream's rows must land on one host at "
            f"every size. Use a mesh that splits rows evenly over the processes, or batch_rampup "
            f"factors whose sizes all do")
    return out
