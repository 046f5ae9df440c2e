"""A producer process's setup (ingest.process): one Arrow thread, and glibc's malloc keeping a
call's freed chunks for the next call instead of faulting them in again.

Each case runs in a fresh interpreter: mallopt settings are process-wide and cannot be undone.
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
    from ingest.process import one_cpu_producer
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
