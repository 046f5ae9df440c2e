"""Settings for a process that produces chunks on one CPU: a Ray worker, or the one-core
``produce`` benchmark, which must run as a worker does."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import tempfile

import pyarrow as pa

__all__ = ["claim_cpu", "one_cpu_producer", "prefault_shared", "shared_mapping"]

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap, not from a fresh mapping of their own (glibc's
# largest on 64-bit), so that a chunk and its intermediates reuse heap pages.
MMAP_THRESHOLD = 32 << 20
# Free memory at the top of the heap kept for the next call, not handed back to the kernel.
TRIM_THRESHOLD = 256 << 20


def one_cpu_producer() -> dict[str, bool]:
    """Sets up this process to produce chunks on one CPU; returns what was applied.

    Arrow: its compute and decode pool defaults to one thread per core of the machine, and
    other threads only contend with the other workers; its default allocator (mimalloc) reads row groups into the row-group cache slower than
    jemalloc or malloc: fresh memory for every group the cache keeps.

    glibc's malloc: a call's chunks (about 2 MiB each) and their
    intermediates are freed once Ray has stored them, and by default malloc gives that memory
    back to the kernel (blocks over 128 KiB are mappings of their own, and a heap top with more
    than twice that free is trimmed), so the next call faults every page in again, zeroed. Kept
    in the heap instead, a worker's page faults fell from about 185k to 124k over 3 epochs of
    the demo, and the feed's steady rate rose 4% (benchmarks/RESULTS.md). The peak memory is
    the same: what is kept is what the next call uses again. Not glibc (musl, macOS): skipped.
    """
    pa.set_cpu_count(1)
    try:
        pa.set_memory_pool(pa.jemalloc_memory_pool())
        jemalloc = True
    except NotImplementedError:  # a pyarrow built without jemalloc
        pa.set_memory_pool(pa.system_memory_pool())
        jemalloc = False
    return {"arrow_jemalloc": jemalloc, "malloc_keeps_freed_memory": _keep_freed_memory()}


def _libc(name: str, *argtypes):
    """The C library's function ``name`` (returning int), or None where there is none (not
    glibc: musl, macOS)."""
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


def _keep_freed_memory() -> bool:
    mallopt = _libc("mallopt", ctypes.c_int, ctypes.c_int)
    return bool(mallopt and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


_claims: list[int] = []  # lock files' descriptors, held for this process's life


def claim_cpu(lock_dir: str | None = None) -> int | None:
    """Binds this process to one CPU of those it may run on that no other claimant holds, and
    returns it; None where none is free or the platform has no CPU affinity (it floats).

    A claim is an exclusive lock on a file per CPU in ``lock_dir`` (default: a folder of this
    user's in the temporary directory), so it ends with the process, however it exits. Each
    worker of every feed on a node claims one: two never share a CPU while another has none,
    and a worker is not moved between CPUs, which costs it its caches. With two workers and the
    host on 2 CPUs, the feed's steady rate rose 4 - 6 % on the demo over 6 epochs and 5 - 7 %
    on tiny documents (benchmarks/RESULTS.md).
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    import fcntl  # noqa: PLC0415 -- POSIX only, like sched_setaffinity

    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return None
    lock_dir = lock_dir or os.path.join(tempfile.gettempdir(), f"ingest-cpus-{os.getuid()}")
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    for cpu in allowed:
        fd = os.open(os.path.join(lock_dir, f"cpu{cpu}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        os.sched_setaffinity(0, {cpu})
        _claims.append(fd)
        return cpu
    return None


# madvise advice (Linux 5.14+): fault a range in as a write would, without writing to it.
_MADV_POPULATE_WRITE = 23
_PREFAULT_STEP = 4 << 20
# File systems whose pages are memory: prefaulting one allocates no disk blocks.
_MEMORY_FS = ("tmpfs", "hugetlbfs")


def _fs_type(path: str, mounts: str = "/proc/self/mounts") -> str | None:
    """The type of the file system holding ``path`` (its longest mount point), or None."""
    best, kind = "", None
    try:
        with open(mounts, encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                point = parts[1].replace("\\040", " ")
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, parts[2]
    except OSError:
        return None
    return kind


def shared_mapping(prefix: str, maps: str = "/proc/self/maps") -> tuple[int, int, str] | None:
    """(start, length, file) of this process's largest shared mapping of a file whose name
    starts with ``prefix`` and whose file system is memory (tmpfs, hugetlbfs); None if none."""
    best = None
    try:
        with open(maps, encoding="utf-8") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) < 6 or parts[1][3:4] != "s":
                    continue
                path = parts[5].strip().removesuffix(" (deleted)")
                if not os.path.basename(path).startswith(prefix):
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if best is None or hi - lo > best[1]:
                    best = (lo, hi - lo, path)
    except OSError:
        return None
    if best is None or _fs_type(os.path.dirname(best[2])) not in _MEMORY_FS:
        return None
    return best


def prefault_shared(prefix: str, nbytes: int) -> int:
    """Maps the first ``nbytes`` (at most half) of the shared memory mapping ``shared_mapping``
    finds into this process's page tables, writable, without reading or writing them; returns
    the bytes prefaulted (0: no such mapping, or a kernel before 5.14).

    For Ray's object store (``prefix="plasma"``): it hands out its lowest free addresses first,
    and a worker that stores a chunk on a page its process has not touched yet takes a page
    fault for it, one that allocates and zeroes the page if no process has: most of the time
    a call spends storing its chunks, unless the first pages of the store are prefaulted.
    The contents stay as they are, so objects already there are safe.
    """
    if nbytes <= 0:
        return 0
    found = shared_mapping(prefix)
    if found is None:
        return 0
    start, length, _ = found
    page = os.sysconf("SC_PAGE_SIZE")
    n = min(-(-nbytes // page) * page, length // 2 // page * page)  # whole pages
    madvise = _libc("madvise", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if madvise is None:
        return 0
    # In steps: the kernel holds the process's memory-map lock through each call, and the
    # process's other threads wait for it to map memory of their own.
    for at in range(0, n, _PREFAULT_STEP):
        if madvise(start + at, min(_PREFAULT_STEP, n - at), _MADV_POPULATE_WRITE) != 0:
            return at
    return n
