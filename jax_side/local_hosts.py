"""``ingest-dev run --hosts N``: N local JAX processes on 127.0.0.1, each with
``--devices-per-host`` forced CPU devices, running the same command; one summary.
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import subprocess
import sys
import threading
from pathlib import Path

__all__ = ["launch_local_hosts"]

# How long the launcher lets the other hosts end on their own after one failed: a host whose
# peer died fails its next collective within milliseconds, and JAX's coordination service
# stops every process within its heartbeat timeout (100 s by default) in any case.
PEER_EXIT_GRACE_S = 60.0

_LAUNCHER_FLAGS = ("--hosts", "--devices-per-host")


def _free_port() -> int:
    # The port is free now; process 0's coordinator binds it a moment later (a small race
    # that only a busy machine loses, with a clear bind error).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _strip_launcher_flags(argv: list[str]) -> list[str]:
    """``argv`` without ``--hosts N`` and ``--devices-per-host D`` (also ``--flag=value`` and
    the abbreviations argparse accepted), everything else in order."""
    p = argparse.ArgumentParser(add_help=False)
    for flag in _LAUNCHER_FLAGS:
        p.add_argument(flag)
    _, rest = p.parse_known_args(argv)
    return rest


def _child_env(devices_per_host: int) -> dict[str, str]:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count="
                                           f"{devices_per_host}"])
    env["JAX_PLATFORMS"] = "cpu"
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def launch_local_hosts(argv: list[str], args: argparse.Namespace, *,
                       workers_per_host: int) -> int:
    """``ingest-dev run --hosts N``: runs the same command as N JAX processes on this machine.

    Each process gets ``--coordinator 127.0.0.1:PORT --num-hosts N --host-id I`` and
    ``args.devices_per_host`` forced CPU devices. With ``--backend ray`` and no cluster given,
    one local Ray cluster is started here and every process joins it. Process 0 prints the one
    summary (stdout, like a single process); the others' output goes to stderr.

    Args:
      argv: the command line as given (without the program name).
      args: its parsed values.
      workers_per_host: Ray workers each process starts.

    Returns:
      0 when every process succeeded, else the first failing process's status. With
      ``--json``, a failure whose last JSON line process 0 did not print itself (another
      process failed first, or process 0 was killed) ends with this command's own.
    """
    child_argv = _strip_launcher_flags(argv)
    n = args.hosts
    ray_started = False
    if args.backend == "ray" and not (args.address or os.environ.get("RAY_ADDRESS")):
        import ray

        from actors.ray_cluster import start_ray

        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
        # Logical CPUs: every host's workers must be placeable, else actors wait forever for
        # CPUs; a small machine runs them oversubscribed (slower, same batches). A cluster of
        # this command's own, which every process joins by its address.
        start_ray(None, num_cpus=max(os.cpu_count() or 1, n * workers_per_host))
        ray_started = True
        child_argv += ["--address", ray.get_runtime_context().gcs_address]
    coordinator = f"127.0.0.1:{_free_port()}"
    env = _child_env(args.devices_per_host)
    procs: list[subprocess.Popen] = []
    ended: queue.Queue = queue.Queue()
    try:
        for i in range(n):
            # ingest-dev's entry point: the command may hold its simulation flags.
            cmd = [sys.executable, "-m", "jax_side.dev", *child_argv, "--coordinator",
                   coordinator, "--num-hosts", str(n), "--host-id", str(i)]
            # Process 0's stdout is this command's (its summary is the last line); the others
            # print nothing there but Ray's or JAX's chatter, sent to stderr instead.
            p = subprocess.Popen(cmd, env=env, stdout=None if i == 0 else sys.stderr)
            procs.append(p)
            threading.Thread(target=lambda i=i, p=p: ended.put((i, p.wait())), daemon=True,
                             name=f"wait-host-{i}").start()
        status = 0
        failure = None
        first_answered = False  # process 0 failed of itself: its own JSON line is the last
        for _ in range(n):
            try:
                i, code = ended.get(timeout=PEER_EXIT_GRACE_S if status else None)
            except queue.Empty:
                stuck = [i for i, p in enumerate(procs) if p.poll() is None]
                failure = (f"host(s) {stuck} of {n} still running {PEER_EXIT_GRACE_S:.0f} s "
                           f"after another failed; killing them")
                print(f"ingest: error: {failure}", file=sys.stderr)
                first_answered = False
                break
            if i == 0 and code > 0:
                first_answered = True
            if code and not status:
                failure = (f"host {i} of {n} exited with status {code}; the others stop at "
                           f"their next collective")
                print(f"ingest: error: {failure}", file=sys.stderr)
                status = code if code > 0 else 128 - code
        if status and args.json and not first_answered:
            from jax_side.run_summary import print_json_error  # noqa: PLC0415

            print_json_error(failure, status)
        return status
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if ray_started:
            import ray

            ray.shutdown()
