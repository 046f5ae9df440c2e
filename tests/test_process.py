"""A producer process's setup (ingest.stream.process): one Arrow thread, glibc's malloc keeping a
call's freed chunks for the next call instead of faulting them in again, a CPU of its own, and
the first pages of a shared memory file (Ray's object store) mapped in ahead of use.

The malloc and CPU cases run in fresh interpreters: those settings are process-wide and cannot
be undone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Eight streams' chunks of 128 x 1024 (24 MiB) made, filled and freed, as a worker's call does;
# prints the page faults per call after the first.
SCRIPT = """
import json, resource, sys
import numpy as np
import pyarrow as pa
applied = {}
if sys.argv[1] == "producer":
    from ingest.stream.process import one_cpu_producer
    applied = one_cpu_producer()
def call():
    chunks = [np.empty((6, 128, 1024), np.int32) for _ in range(8)]
    for c in chunks:
        c.fill(1)
    return sum(int(c[0, 0, 0]) for c in chunks)
call()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    call()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10
print(json.dumps({"faults_per_call": faults, "applied": applied, "arrow_threads": pa.cpu_count(),
                  "pool": pa.default_memory_pool().backend_name}))
"""


def _run(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_producer_keeps_freed_chunks_instead_of_faulting_them_in_again():
    plain, producer = _run("plain"), _run("producer")
    assert producer["applied"] == {"arrow_jemalloc": True, "malloc_keeps_freed_memory": True}
    assert producer["arrow_threads"] == 1 and producer["pool"] == "jemalloc"
    # 24 MiB is 6,144 pages: given back and faulted in again by default, kept when set up.
    assert plain["faults_per_call"] > 3000, plain
    assert producer["faults_per_call"] < 300, producer


CLAIM = """
import os, sys
from ingest.stream.process import claim_cpu
cpu = claim_cpu(sys.argv[1])
print(cpu, sorted(os.sched_getaffinity(0)), flush=True)
sys.stdin.readline()  # holds the claim until told to exit
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="CPU affinity")
def test_claim_cpu_gives_each_process_its_own_cpu_until_none_is_free(tmp_path):
    import os

    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one CPU: nothing to choose")

    def start():
        p = subprocess.Popen([sys.executable, "-c", CLAIM, str(tmp_path)], cwd=ROOT, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        line = p.stdout.readline().split(" ", 1)
        return p, (None if line[0] == "None" else int(line[0])), json.loads(line[1])

    procs = [start() for _ in range(len(allowed) + 1)]
    try:
        claimed = [cpu for _, cpu, _ in procs[:-1]]
        assert sorted(claimed) == allowed  # one each, all different
        assert all(aff == [cpu] for _, cpu, aff in procs[:-1])
        assert procs[-1][1] is None and procs[-1][2] == allowed  # none free: it floats
        # A claim ends with its process: the next one gets that CPU.
        first, cpu0, _ = procs[0]
        first.communicate("\n", timeout=30)
        again = start()
        procs.append(again)
        assert again[1] == cpu0 and again[2] == [cpu0]
    finally:
        for p, _, _ in procs:
            if p.poll() is None:
                p.communicate("\n", timeout=30)


def _resident_kib(start: int) -> int:
    """Resident KiB of this process's mapping that starts at ``start`` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) == start
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping at {start:#x}")


def test_prefault_shared_maps_the_first_pages_of_a_memory_file_and_keeps_its_contents(tmp_path):
    import mmap
    import os
    import tempfile

    from ingest.stream.process import _fs_type, prefault_shared, shared_mapping

    if _fs_type("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    size, page = 8 << 20, os.sysconf("SC_PAGE_SIZE")
    fd, path = tempfile.mkstemp(prefix="ingest-prefault-", dir="/dev/shm")
    os.unlink(path)  # as Ray's store file is: the mapping names it "(deleted)"
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED)
    try:
        m[:4] = b"keep"
        m[5 << 20:(5 << 20) + 4] = b"also"  # one page past the half that will be prefaulted
        start, length, found = shared_mapping("ingest-prefault-")
        assert (length, found) == (size, path)
        assert _resident_kib(start) == 2 * page // 1024
        got = prefault_shared("ingest-prefault-", 6 << 20)
        if got == 0:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
        assert got == 4 << 20  # at most half of the mapping
        assert _resident_kib(start) == (4 << 10) + page // 1024
        assert m[:4] == b"keep" and m[5 << 20:(5 << 20) + 4] == b"also"
        assert m[4:page] == bytes(page - 4)
        assert prefault_shared("no-such-file-", 1 << 20) == 0
    finally:
        m.close()
        os.close(fd)
    # A file on a disk is never prefaulted: that would write its pages out.
    if _fs_type(str(tmp_path)) not in ("tmpfs", "hugetlbfs"):
        with open(tmp_path / "ingest-prefault-disk", "wb") as f:
            f.truncate(size)
        with open(tmp_path / "ingest-prefault-disk", "r+b") as f:
            disk = mmap.mmap(f.fileno(), size, mmap.MAP_SHARED)
            try:
                assert shared_mapping("ingest-prefault-disk") is None
                assert prefault_shared("ingest-prefault-disk", 1 << 20) == 0
            finally:
                disk.close()
