"""Running one measured program: a subprocess with a deadline, its process tree sampled.

The sampler reads, every ``interval_s``, the resident memory (RSS) of the subprocess and all
its descendants (Ray's raylet, GCS and workers are children of a driver that starts its own
cluster; grain's prefetch processes are children of the main one), grouped by role:

    host              the subprocess itself (the JAX process, Ray driver, grain main process)
    workers           processes doing the pipeline's work: Ray actors and tasks, grain workers
    ray_idle_workers  Ray's pooled worker processes that hold no actor or task
    ray_system        raylet, GCS, Ray's agents and monitors

A group's peak is the largest sum over its processes in one sample; ``max_process`` is the
largest single process. With a Ray cluster in the tree, the object store's bytes in use are
polled from the raylet (the figure ``ray memory --stats-only`` prints) and the peak kept.
RSS counts the object-store pages a process has mapped and touched, so the groups overlap
where processes read shared chunks.

CPU time (user + system) is kept per process and summed per group, next to the CPU time the
whole machine spent in the same wall time: what other programs took shows whether the figures
were measured on a quiet machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import threading
import time
from typing import Any

import psutil

__all__ = ["RunResult", "TreeSampler", "busy_between", "machine_busy_cpu_s", "machine_steal_s",
           "process_start_time", "run_measured"]

GROUPS = ("host", "workers", "ray_idle_workers", "ray_system")
STORE_POLL_S = 1.0  # one small RPC to the raylet per second
# Ray's pooled processes before they take a task show either title.
_IDLE_TITLES = ("ray::IDLE", "ray::default_worker")
_AGENT_TITLES = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def process_start_time() -> float:
    """Wall-clock time this process started, to the kernel clock tick (10 ms).

    Same method as ``ingest run``'s ``startup_s``: the process's age from /proc, subtracted
    from now, so startups of our run and of the peers are measured alike.
    """
    with open("/proc/self/stat", encoding="ascii") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime", encoding="ascii") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def _stat_fields(path: str) -> list[str] | None:
    """The fields after the command name of a /proc stat file (field 3 on), or None."""
    try:
        with open(path, encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _minor_faults(pid: int) -> int:
    """The process's minor page faults so far, or -1 where unreadable."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    return int(fields[7]) if fields else -1


def _main_thread_cpu_s(pid: int) -> float:
    """CPU seconds of the process's main thread alone, or -1 where unreadable."""
    fields = _stat_fields(f"/proc/{pid}/task/{pid}/stat")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else -1.0


def machine_busy_cpu_s() -> float:
    """CPU time every CPU of the machine has spent busy since boot, in seconds."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def machine_steal_s() -> float:
    """CPU time the hypervisor gave to other machines: contention a guest cannot see."""
    return getattr(psutil.cpu_times(), "steal", 0.0)


def process_group(cmdline: list[str], is_root: bool) -> str:
    if is_root:
        return "host"
    first = cmdline[0] if cmdline else ""
    if os.path.basename(first) in ("raylet", "gcs_server"):
        return "ray_system"
    if first.startswith("ray::"):
        if first.startswith(_AGENT_TITLES):
            return "ray_system"
        return "ray_idle_workers" if first.startswith(_IDLE_TITLES) else "workers"
    if len(cmdline) > 2 and cmdline[2].endswith("ray/_private/workers/default_worker.py"):
        return "ray_idle_workers"  # python setup_worker.py default_worker.py, before its title
    if any("/site-packages/ray/" in a for a in cmdline[:3]):
        return "ray_system"  # dashboard, log monitor, autoscaler monitor, agents
    return "workers"


@dataclasses.dataclass
class _Peak:
    sum_bytes: int = 0
    max_process_bytes: int = 0
    max_process_own_bytes: int = 0  # RSS less shared-memory pages (Ray's object store)
    max_processes: int = 0


def own_bytes(pid: int) -> int | None:
    """A process's RSS less its resident shared-memory pages (``RssShmem``), both from one read
    of its status (None if unreadable: it is exiting). For Ray's processes the shared pages are
    mostly the object store, which every process that writes or reads objects maps: they count
    in its RSS, and grow as it touches more of the store, though the store is bounded on its
    own. Both come from one read: read separately, a failed read of the shared pages would
    count a worker's RSS with the store as its own memory."""
    fields: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(("VmRSS:", "RssShmem:")):
                    fields[line.split(":")[0]] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if len(fields) != 2:
        return None
    return fields["VmRSS"] - fields["RssShmem"]


def busy_between(series: list, t_a: float, t_b: float, min_s: float = 1.0
                 ) -> dict[str, Any] | None:
    """From a ``cpu_series`` (``TreeSampler.stop``): the cores each group kept busy between
    ``t_a`` and ``t_b`` seconds after the sampler started (the samples nearest inside), and
    each worker's, busiest first; None where the samples inside span less than ``min_s``
    (CPU time comes in ticks of 10 ms: a shorter span says little)."""
    inside = [(t, d) for t, d in series if t_a <= t <= t_b]
    if len(inside) < 2 or inside[-1][0] - inside[0][0] < min_s:
        return None
    (ta, a), (tb, b) = inside[0], inside[-1]
    dt = tb - ta
    groups: dict[str, float] = {}
    workers = []
    for pid, (g, c) in b.items():
        if pid not in a:
            continue
        busy = (c - a[pid][1]) / dt
        groups[g] = groups.get(g, 0.0) + busy
        if g == "workers":
            workers.append(round(busy, 3))
    return {"from_s": ta, "to_s": tb, "cores": {g: round(v, 3) for g, v in groups.items()},
            "workers": sorted(workers, reverse=True)}


class TreeSampler:
    """Samples a process tree's memory (and Ray's object store) on a background thread.

    Args:
      pid: the root process.
      interval_s: seconds between samples; each costs a few ms of one CPU, taken from the
        measured program on a small machine, so keep it coarse.
      poll_object_store: also ask a raylet in the tree for the object store's bytes in use
        (every ``STORE_POLL_S``).
    """

    def __init__(self, pid: int, *, interval_s: float = 0.25, poll_object_store: bool = True):
        self._root = psutil.Process(pid)
        self._interval = interval_s
        self._peaks = {g: _Peak() for g in GROUPS}
        self._total_peak = 0
        self._samples = 0
        self._cpu: dict[int, tuple[str, float]] = {}  # pid -> (group, CPU seconds so far)
        # (seconds since start, {pid: (group, CPU seconds so far)}) per sample
        self._series: list[tuple[float, dict[int, tuple[str, float]]]] = []
        # pid -> (user s, system s, main thread's s, minor page faults, voluntary and
        # involuntary context switches so far, the CPU it is bound to or None), for the
        # workers' group
        self._worker_detail: dict[int, tuple] = {}
        self._machine_cpu0 = machine_busy_cpu_s()
        self._steal0 = machine_steal_s()
        self._t0 = time.perf_counter()
        self._poll_store = poll_object_store
        self._store_stub = None
        self._store_peak: int | None = None
        self._store_created: int | None = None
        self._store_error: str | None = None
        self._store_polls = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, name="TreeSampler", daemon=True)]
        if poll_object_store:
            # Its own thread: connecting to a cluster that is still starting can block for
            # seconds, and must not leave gaps in the memory samples.
            self._threads.append(threading.Thread(target=self._store_loop,
                                                  name="ObjectStorePoller", daemon=True))

    def start(self) -> TreeSampler:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> dict[str, Any]:
        """Stops sampling; returns the peaks (bytes) and the object-store figures."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        wall = time.perf_counter() - self._t0
        machine = machine_busy_cpu_s() - self._machine_cpu0
        cpu = dict.fromkeys(GROUPS, 0.0)
        for group, seconds in self._cpu.values():
            cpu[group] += seconds
        tree = sum(cpu.values())
        out: dict[str, Any] = {"samples": self._samples, "interval_s": self._interval,
                               "total_peak_bytes": self._total_peak,
                               "wall_s": wall, "cpu_s": cpu, "tree_cpu_s": tree,
                               "machine_cpu_s": machine,
                               # The sampler's own few ms per sample are in here too.
                               "other_programs_cpu_s": max(0.0, machine - tree),
                               "machine_steal_s": machine_steal_s() - self._steal0,
                               "workers_cpu_s": sorted(
                                   (round(sec, 3) for g, sec in self._cpu.values()
                                    if g == "workers"), reverse=True),
                               "workers_detail": sorted(
                                   ({"user_s": round(u, 3), "system_s": round(sy, 3),
                                     "main_thread_s": round(mt, 3), "minor_faults": f,
                                     "voluntary_switches": v, "involuntary_switches": i,
                                     "bound_to_cpu": c}
                                    for u, sy, mt, f, v, i, c in self._worker_detail.values()),
                                   key=lambda d: -(d["user_s"] + d["system_s"]))}
        out["cpu_series"] = [[round(t, 3), {str(pid): [g, round(c, 3)]
                                            for pid, (g, c) in d.items()}]
                             for t, d in self._series]
        for g, p in self._peaks.items():
            out[g] = {"peak_bytes": p.sum_bytes, "max_process_bytes": p.max_process_bytes,
                      "max_process_own_bytes": p.max_process_own_bytes,
                      "max_processes": p.max_processes}
        if self._poll_store:
            out["object_store"] = {"used_peak_bytes": self._store_peak,
                                   "cumulative_created_bytes": self._store_created,
                                   "polls_ok": self._store_polls}
            if self._store_peak is None:
                out["object_store"]["error"] = self._store_error or "no Ray cluster was seen"
        return out

    def _loop(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self._interval):
                return

    def _store_loop(self) -> None:
        while not self._stop.wait(STORE_POLL_S):
            self._poll_object_store()

    def _tree(self) -> list[tuple[psutil.Process, bool]]:
        try:
            kids = self._root.children(recursive=True)
        except psutil.Error:
            return []
        return [(self._root, True)] + [(k, False) for k in kids]

    def _sample(self) -> None:
        sums = dict.fromkeys(GROUPS, 0)
        counts = dict.fromkeys(GROUPS, 0)
        biggest = dict.fromkeys(GROUPS, 0)
        own = dict.fromkeys(GROUPS, 0)
        for proc, is_root in self._tree():
            try:
                rss = proc.memory_info().rss
                group = process_group(proc.cmdline(), is_root)
                t = proc.cpu_times()
            except psutil.Error:
                continue  # it ended between listing and reading
            # A process is counted in the group it last had (Ray's idle workers become actors).
            self._cpu[proc.pid] = (group, t.user + t.system)
            if group == "workers":
                try:
                    ctx = proc.num_ctx_switches()
                    cpus = proc.cpu_affinity()
                    self._worker_detail[proc.pid] = (
                        t.user, t.system, _main_thread_cpu_s(proc.pid),
                        _minor_faults(proc.pid), ctx.voluntary, ctx.involuntary,
                        cpus[0] if len(cpus) == 1 else None)
                except psutil.Error:
                    pass
            sums[group] += rss
            counts[group] += 1
            biggest[group] = max(biggest[group], rss)
            mine = own_bytes(proc.pid)
            if mine is not None:
                own[group] = max(own[group], mine)
        self._samples += 1
        self._series.append((time.perf_counter() - self._t0, dict(self._cpu)))
        self._total_peak = max(self._total_peak, sum(sums.values()))
        for g in GROUPS:
            p = self._peaks[g]
            p.sum_bytes = max(p.sum_bytes, sums[g])
            p.max_process_bytes = max(p.max_process_bytes, biggest[g])
            p.max_process_own_bytes = max(p.max_process_own_bytes, own[g])
            p.max_processes = max(p.max_processes, counts[g])

    def _raylet(self) -> psutil.Process | None:
        for proc, _ in self._tree():
            try:
                cmd = proc.cmdline()
            except psutil.Error:
                continue
            if cmd and os.path.basename(cmd[0]) == "raylet":
                return proc
        return None

    def _connect_object_store(self):
        """A stub on the raylet's node manager, or None while the cluster is still starting.

        The raylet picks its ports at start (its command line says 0), and asking the GCS for
        them can block for a minute while it starts; so try the raylet's listening ports
        directly: the node manager is the one that answers.
        """
        raylet = self._raylet()
        if raylet is None:
            return None
        # The driver decides the cluster's auth mode (token by default) and passes it to its
        # children only: speak the same mode, as `ray memory` run beside it would.
        mode = raylet.environ().get("RAY_AUTH_MODE")
        if mode and "RAY_AUTH_MODE" not in os.environ:
            os.environ["RAY_AUTH_MODE"] = mode
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # not gRPC's notes on closed channels
        from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc

        from benchmarks.private_api import raylet_channel

        ports = sorted({c.laddr.port for c in raylet.net_connections("tcp")
                        if c.status == psutil.CONN_LISTEN})
        for port in ports:
            stub = node_manager_pb2_grpc.NodeManagerServiceStub(
                raylet_channel(f"127.0.0.1:{port}"))
            try:
                stub.FormatGlobalMemoryInfo(
                    node_manager_pb2.FormatGlobalMemoryInfoRequest(include_memory_info=False),
                    timeout=1.0)
            except Exception:  # noqa: BLE001 -- not the node manager, or not up yet
                continue
            return stub
        return None

    def _poll_object_store(self) -> None:
        try:
            if self._store_stub is None:
                self._store_stub = self._connect_object_store()
                if self._store_stub is None:
                    return
            from ray.core.generated import node_manager_pb2

            reply = self._store_stub.FormatGlobalMemoryInfo(
                node_manager_pb2.FormatGlobalMemoryInfoRequest(include_memory_info=False),
                timeout=5.0)
        except Exception as e:  # noqa: BLE001 -- a cluster starting or stopping: try again
            details = getattr(e, "details", None)
            text = details() if callable(details) else str(e)
            self._store_error = f"{type(e).__name__}: {(text or '').splitlines()[0][:200]}"
            return
        s = reply.store_stats
        self._store_polls += 1
        self._store_peak = max(self._store_peak or 0, int(s.object_store_bytes_used))
        self._store_created = int(s.cumulative_created_bytes)


@dataclasses.dataclass
class RunResult:
    """One measured subprocess.

    Attributes:
      command: the argv run.
      returncode: its exit status (None when it was killed at the deadline).
      timed_out: it ran past ``timeout_s`` and was killed.
      wall_s: from spawn to exit.
      summary: the JSON object on the last line of its stdout, or None.
      memory: ``TreeSampler.stop()``'s figures, or None when not sampled.
      stderr_tail: the last lines of its stderr (for error reports).
    """

    command: list[str]
    returncode: int | None
    timed_out: bool
    wall_s: float
    summary: dict[str, Any] | None
    memory: dict[str, Any] | None
    stderr_tail: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.summary is not None

    def error(self) -> str:
        """What went wrong, for the results file: the exit, then the end of stderr."""
        if self.timed_out:
            head = f"timed out after {self.wall_s:.0f} s and was killed"
        elif self.returncode != 0:
            head = f"exited with status {self.returncode}"
        else:
            head = "printed no JSON summary on the last line of stdout"
        tail = self.stderr_tail.strip().splitlines()[-6:]
        return head + (": " + " | ".join(tail) if tail else "")


def _last_json_line(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
        if line:
            return None
    return None


def run_measured(command: list[str], *, timeout_s: float, env: dict[str, str] | None = None,
                 cwd: str | None = None, sample: bool = True,
                 poll_object_store: bool = False) -> RunResult:
    """Runs ``command`` to completion or ``timeout_s``, sampling its process tree.

    On the deadline the whole process group is killed (Ray's raylet and workers included), so
    a hung peer never outlives its measurement.
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd, start_new_session=True)
    sampler = (TreeSampler(proc.pid, poll_object_store=poll_object_store).start() if sample
               else None)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_tree(proc.pid)
        out, err = proc.communicate()
    finally:
        memory = sampler.stop() if sampler is not None else None
    wall = time.perf_counter() - t0
    # Ray and grain may leave helpers behind in the group on a crash; they are ours to end.
    _kill_group(proc.pid)
    return RunResult(command=list(command), returncode=None if timed_out else proc.returncode,
                     timed_out=timed_out, wall_s=wall,
                     summary=_last_json_line(out) if not timed_out else None,
                     memory=memory, stderr_tail="\n".join(err.splitlines()[-40:]))


def _kill_group(pid: int) -> None:
    import signal

    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(pid: int) -> None:
    """Kills a process, its group, and every descendant by pid: Ray starts its daemons in
    sessions of their own, and they would otherwise outlive a killed driver by seconds."""
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        kids = []
    _kill_group(pid)
    for k in kids:
        try:
            k.kill()
        except psutil.Error:
            pass
