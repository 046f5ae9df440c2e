"""The machine a benchmark runs on: its CPUs, memory, packages, and how busy it is.

Also the environment every measured program runs in (``child_env``): benchmarks/ on the path
and no outside Ray cluster.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any

from benchmarks.measure import machine_busy_cpu_s

__all__ = ["BUSY_PROBE_S", "ROOT", "busy_cpus", "child_env", "machine_facts", "package_versions"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUSY_PROBE_S = 2.0  # long enough to average over the scheduler's ticks, short beside a run


def child_env() -> dict[str, str]:
    """This process's environment for a measured program: it imports benchmarks/ from the
    checkout and starts its own local Ray cluster."""
    env = dict(os.environ)
    # benchmarks/ is not an installed package: the measured programs import it from here.
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # Each run starts, and is timed with, its own local cluster on loopback. Ray
    # reads this variable when it is imported, so it must be in the environment from the start.
    env.pop("RAY_ADDRESS", None)
    env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    return env


def busy_cpus(seconds: float = BUSY_PROBE_S) -> float:
    """CPUs the machine kept busy, on average, over the next ``seconds`` (this process sleeps):
    other programs running at the start. The load average would also count, for a minute
    after it ended, a benchmark run just before."""
    before = machine_busy_cpu_s()
    time.sleep(seconds)
    return (machine_busy_cpu_s() - before) / seconds


def machine_facts() -> dict[str, Any]:
    import psutil

    model = ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                         "")
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "cpu_siblings": _cpu_siblings(),
            "memory_bytes": psutil.virtual_memory().total, "platform": platform.platform(),
            "python": platform.python_version(), "load_average_start": os.getloadavg(),
            "busy_cpus_start": busy_cpus()}


def _cpu_siblings(root: str = "/sys/devices/system/cpu") -> list[list[int]]:
    """The CPUs that share a physical core (hyperthreads), one list per core, as the kernel
    reports them; [] where it does not."""
    cores = set()
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else ():
        path = os.path.join(root, name, "topology", "thread_siblings_list")
        if not (name.startswith("cpu") and name[3:].isdigit() and os.path.exists(path)):
            continue
        with open(path, encoding="ascii") as f:
            cpus = []
            for part in f.read().strip().split(","):
                a, _, b = part.partition("-")
                cpus.extend(range(int(a), int(b or a) + 1))
        cores.add(tuple(cpus))
    return [list(c) for c in sorted(cores)]


def package_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("ingest", "jax", "jaxlib", "grain", "ray", "pyarrow", "numpy", "tiktoken",
                 "tokenizers", "pandas"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    return out
