"""The memory check: batch and chunk sizes whose buffers cannot fit in this machine's memory
are refused before anything runs (``check_memory``)."""

from __future__ import annotations

import os
from typing import Any

from ingest.errors import ConfigError
from ingest.runtime import resolve_runtime
from ingest.stream.chunk_format import chunk_token_bytes

__all__ = ["check_memory", "machine_memory"]

# Batches a host keeps at once: one being filled, HostFeed's default device_prefetch (4)
# waiting, one in the training step.
HOST_BATCHES = 6
BYTES_PER_ROW_TOKEN = 6 * 4  # a batch's six int32 fields


def machine_memory() -> tuple[int, str]:
    """Bytes of memory this process may use, and where that figure comes from: the physical
    memory, or the cgroup's limit (a container) when that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    where = "physical memory"
    for limit_file in ("/sys/fs/cgroup/memory.max",
                       "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit_file, encoding="ascii") as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit() and int(limit) < total:
            total, where = int(limit), f"memory limit ({limit_file})"
        break
    return total, where


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def check_memory(config: Any, *, streams: int | None = None,
                 host_batches: int = HOST_BATCHES, memory: tuple[int, str] | None = None) -> None:
    """Refuses batch and chunk sizes whose buffers cannot fit in this machine's memory.

    A batch's row is ``seq_len x 6 fields x 4 bytes``, a chunk's ``seq_len x
    ingest.stream.chunk_format.chunk_token_bytes``. A host keeps ``host_batches`` batches of its
    rows (its ``streams``' share of the largest global batch, ``batch_rampup`` included); each
    of the streams keeps ``prefetch`` chunks in flight, one being read and one being produced
    (``chunk_rows`` rows each), on this machine with the local backend or a one-machine
    cluster.

    Args:
      config: a validated ``ingest.config.Config``.
      streams: the streams this host owns (default: all).
      host_batches: batches the host keeps (0: none, for a job that forms no batches).
      memory: ``(bytes, what)`` to compare with (default: ``machine_memory()``).

    Raises:
      ConfigError: naming the fields, the bytes they need and the memory there is.
    """
    total, what = memory if memory is not None else machine_memory()
    have = f"this machine's {_size(total)} of {what}"
    owned = config.num_streams if streams is None else streams
    row = config.seq_len * BYTES_PER_ROW_TOKEN
    problems = []
    rows, label = max((size, label) for size, label in config.batch_sizes().items())
    host = rows * owned // config.num_streams
    batch_need = host_batches * host * row
    if batch_need > total:
        which = "global_batch_size" if label.startswith("global_batch_size") else "that factor"
        problems.append(
            f"{label}: {host:,} rows on this host x "
            f"seq_len={config.seq_len:,} x 6 fields x 4 bytes = {_size(host * row)} per batch; "
            f"the host keeps {host_batches} (one being filled, the prefetched ones, one in "
            f"use): {_size(batch_need)}, more than {have}. Lower {which} or seq_len")
    runtime = resolve_runtime(config)
    per_stream = runtime.prefetch + 2
    chunk_need = owned * per_stream * runtime.chunk_bytes
    if chunk_need > total:
        lower = ("prefetch or seq_len" if runtime.chunk_rows == 1
                 else "chunk_rows, prefetch or seq_len")
        auto = " (automatic)" if runtime.is_auto("chunk_rows") else ""
        problems.append(
            f"chunk_rows={runtime.chunk_rows:,}{auto}"
            f" x seq_len={config.seq_len:,} x {chunk_token_bytes(config.seq_len)} bytes a "
            f"token = {_size(runtime.chunk_bytes)} per chunk; {owned} stream(s) keep up to "
            f"prefetch={runtime.prefetch} + 2 chunks each (in flight, being read, being "
            f"produced): {_size(chunk_need)}, more than {have}. Lower {lower}")
    if not problems and batch_need + chunk_need > total:
        problems.append(
            f"the batches ({_size(batch_need)}: {host_batches} x {host:,} rows x "
            f"seq_len={config.seq_len:,} x 6 fields x 4 bytes) and chunks ({_size(chunk_need)}: "
            f"{owned} stream(s) x {per_stream} x chunk_rows={runtime.chunk_rows:,} rows) need "
            f"{_size(batch_need + chunk_need)}, more than {have}. Lower global_batch_size, "
            f"chunk_rows or seq_len")
    if problems:
        raise ConfigError(problems)
