"""Joining the JAX processes of a run: with ``--coordinator``/``--num-hosts``/``--host-id``, or
through ``jax.distributed.initialize()``'s own cluster detection wherever the environment shows
a cluster of several processes; and leaving at once when a run fails.

The environment shows a cluster through the variables its launcher sets for every process
(``cluster_hints``)::

    SLURM (srun)            SLURM_JOB_ID with SLURM_NTASKS                   N processes
    Open MPI (mpirun)       OMPI_COMM_WORLD_SIZE, or OMPI_MCA_orte_hnp_uri   N, or unknown
    MPI (PMI)               PMI_SIZE                                         N
    Kubernetes indexed Job  JOB_COMPLETION_INDEX with KUBERNETES_SERVICE_HOST unknown
    Cloud TPU               TPU_WORKER_HOSTNAMES, TPU_PROCESS_ADDRESSES      N
                            MEGASCALE_COORDINATOR_ADDRESS                    unknown
    JAX                     JAX_COORDINATOR_ADDRESS                          unknown

Where every hint with a count shows one process and none leaves the count open, the process
runs alone. Otherwise it calls ``jax.distributed.initialize()``, which finds the coordinator,
the process count and this process's index itself, and a failure is an error, never a quiet
run alone: JAX recognizes none of these environments (say, Kubernetes without the
``kubernetes`` package: ``pip install 'ingest[k8s]'``), or the other processes do not arrive
within the join timeout. A plain Kubernetes pod (``KUBERNETES_SERVICE_HOST`` alone) is one
process. On a Cloud TPU VM that sets none of these, nothing is joined here: on TPU,
``jax.distributed.initialize()`` is optional (the TPU runtime connects a pod slice's hosts).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import sys
import threading
import time

import jax

# How long process 0 stays after its error before it leaves (see ``leave``).
LEADER_GRACE_S = 2.0
# How long the processes of a run may take to arrive at the join (JAX's own default): the
# hosts of a cluster job start within minutes of each other.
JOIN_TIMEOUT_S = 300.0
# JAX aborts the process when its own join deadline passes: it gets this much longer than
# ``timeout_s``, so that the join's watchdog reports first.
_JAX_DEADLINE_MARGIN_S = 30

__all__ = ["ClusterHint", "ClusterJoinError", "cluster_hints", "initialize", "leave"]

log = logging.getLogger("ingest.multihost")


class ClusterJoinError(RuntimeError):
    """This process could not join the JAX processes of the cluster environment it is in."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterHint:
    """A variable that shows this process is one of several.

    Attributes:
      environment: the launcher or platform, for messages (``SLURM``, ``Kubernetes``).
      evidence: what shows it, as ``NAME=value``.
      processes: the process count it gives, or None where it gives none.
      fix: what to do when JAX cannot join the processes it shows.
    """

    environment: str
    evidence: str
    processes: int | None
    fix: str


def _count(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _listed(value: str) -> int:
    return len([x for x in value.split(",") if x.strip()])


def cluster_hints(environ: dict[str, str] | None = None) -> list[ClusterHint]:
    """The variables in ``environ`` (default: this process's environment) that show this
    process is one of several (see the module docstring); [] where there are none."""
    env = os.environ if environ is None else environ
    flags = "pass --coordinator HOST:PORT --num-hosts N --host-id I"
    hints = []
    if "SLURM_JOB_ID" in env and "SLURM_NTASKS" in env:
        hints.append(ClusterHint(
            environment="SLURM", evidence=f"SLURM_NTASKS={env['SLURM_NTASKS']}",
            processes=_count(env["SLURM_NTASKS"]),
            fix="start one process per task with srun (srun ... ingest run ...), or "
                f"{flags}; to run one process alone, unset SLURM_NTASKS"))
    if "OMPI_COMM_WORLD_SIZE" in env or "OMPI_MCA_orte_hnp_uri" in env:
        size = env.get("OMPI_COMM_WORLD_SIZE")
        hints.append(ClusterHint(
            environment="Open MPI",
            evidence=(f"OMPI_COMM_WORLD_SIZE={size}" if size is not None
                      else "OMPI_MCA_orte_hnp_uri"),
            processes=_count(size),
            fix="JAX finds Open MPI's coordinator through OMPI_MCA_orte_hnp_uri (Open MPI 4, "
                f"mpirun); elsewhere {flags} with I=$OMPI_COMM_WORLD_RANK"))
    if "PMI_SIZE" in env:
        hints.append(ClusterHint(
            environment="MPI (PMI)", evidence=f"PMI_SIZE={env['PMI_SIZE']}",
            processes=_count(env["PMI_SIZE"]), fix=f"{flags} with I=$PMI_RANK"))
    if "JOB_COMPLETION_INDEX" in env and "KUBERNETES_SERVICE_HOST" in env:
        k8s = ("" if importlib.util.find_spec("kubernetes") is not None else
               "install the kubernetes package that JAX's detection needs (pip install "
               "'ingest[k8s]'), and ")
        hints.append(ClusterHint(
            environment="Kubernetes indexed Job",
            evidence=f"JOB_COMPLETION_INDEX={env['JOB_COMPLETION_INDEX']}", processes=None,
            fix=f"{k8s}give the pods a service account that may read pods and jobs, and a "
                f"headless service as the Job's subdomain (JAX's Kubernetes detection); or "
                f"{flags} with I=$JOB_COMPLETION_INDEX"))
    for name in ("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES"):
        if env.get(name):
            hints.append(ClusterHint(
                environment="Cloud TPU", evidence=f"{name}={env[name]}",
                processes=_listed(env[name]), fix=f"check the TPU slice's hosts, or {flags}"))
            break
    if env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        hints.append(ClusterHint(
            environment="Cloud TPU (multislice)",
            evidence=f"MEGASCALE_COORDINATOR_ADDRESS={env['MEGASCALE_COORDINATOR_ADDRESS']}",
            processes=None, fix=f"check the slices' hosts, or {flags}"))
    if env.get("JAX_COORDINATOR_ADDRESS"):
        address = env["JAX_COORDINATOR_ADDRESS"]
        hints.append(ClusterHint(
            environment="JAX", evidence=f"JAX_COORDINATOR_ADDRESS={address}", processes=None,
            fix="start the processes under a launcher JAX detects (SLURM, Open MPI, "
                f"Kubernetes, Cloud TPU), or pass --coordinator {address} --num-hosts N "
                f"--host-id I"))
    return hints


def initialize(coordinator: str | None, num_hosts: int | None, host_id: int | None, *,
               timeout_s: float = JOIN_TIMEOUT_S) -> None:
    """Joins this process to the others with ``jax.distributed.initialize``, before anything
    touches a JAX device: with the three values from the command line, else with no arguments
    (JAX's own cluster detection) wherever ``cluster_hints`` shows several processes or leaves
    their count open; else does nothing.

    A join that does not complete within ``timeout_s`` (the other processes never arrive)
    ends this process with status 1 and one line on stderr, naming the environment and the
    fix: JAX itself would abort it with a native stack trace.

    Raises:
      ClusterJoinError: the environment shows several processes but
        ``jax.distributed.initialize()`` could not join them (naming what shows them and the
        fix).
    """
    if jax.distributed.is_initialized():
        return
    if coordinator is not None:
        log.info("joining %d JAX processes as process %d through %s", num_hosts, host_id,
                 coordinator)
        _join(dict(coordinator_address=coordinator, num_processes=num_hosts,
                   process_id=host_id), timeout_s,
              f"--coordinator {coordinator} --num-hosts {num_hosts} --host-id {host_id}",
              "start every process with the same --coordinator and --num-hosts and its own "
              "--host-id, process 0 on the coordinator's host")
        return
    hints = cluster_hints()
    if not hints:
        return
    shown = "; ".join(f"{h.environment}: {h.evidence}" for h in hints)
    if all(h.processes is not None and h.processes <= 1 for h in hints):
        log.info("the environment shows one process (%s): running as a single host", shown)
        return
    log.info("the environment suggests several processes (%s): joining them through "
             "jax.distributed.initialize()", shown)
    fix = "; ".join(dict.fromkeys(h.fix for h in hints))
    try:
        _join({}, timeout_s, shown, fix)
    except Exception as e:
        raise ClusterJoinError(
            f"the environment suggests several JAX processes ({shown}), but "
            f"jax.distributed.initialize() could not join them: {type(e).__name__}: "
            f"{_one_line(e)}. To fix: {fix}") from e
    log.info("joined as process %d of %d", jax.process_index(), jax.process_count())


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()).rstrip(".")


def _join(kwargs: dict, timeout_s: float, shown: str, fix: str) -> None:
    """``jax.distributed.initialize(**kwargs)``, leaving the process with one line on stderr
    if it has not returned after ``timeout_s``."""
    done = threading.Event()

    def watchdog() -> None:
        if not done.wait(timeout_s):
            print(f"ingest: error: the JAX processes ({shown}) did not all arrive within "
                  f"{timeout_s:g} s at jax.distributed.initialize(): some never started, "
                  f"were started with other settings, or cannot reach the coordinator. To "
                  f"fix: {fix}", file=sys.stderr, flush=True)
            _exit(1)  # not leave(): JAX's state is half made, and this is not its thread

    threading.Thread(target=watchdog, name="join-deadline", daemon=True).start()
    try:
        jax.distributed.initialize(
            **kwargs, initialization_timeout=int(timeout_s) + _JAX_DEADLINE_MARGIN_S)
    finally:
        done.set()


def leave(code: int) -> None:
    """Exits this process after flushing its output (process 0 after a short grace).

    A process of a failed multi-process run must not linger: at a normal exit,
    ``jax.distributed`` waits at a shutdown barrier (up to 5 minutes) for every process, while
    those wait for this one in their next collective. Leaving closes its sockets, so the peers'
    collectives fail within milliseconds and they report it. Process 0 holds the coordination
    service, whose end aborts every peer: it waits ``LEADER_GRACE_S`` first, so that peers
    meeting the same error at start (a config, a mesh) name it themselves.
    """
    if jax.distributed.is_initialized() and jax.process_count() > 1 and jax.process_index() == 0:
        for stream in (sys.stdout, sys.stderr):
            _flush(stream)
        time.sleep(LEADER_GRACE_S)
    _exit(code)


def _flush(stream) -> None:
    try:
        stream.flush()
    except (OSError, ValueError):
        pass


def _exit(code: int) -> None:
    """Exits at once, after flushing the output and the logs."""
    for stream in (sys.stdout, sys.stderr):
        _flush(stream)
    logging.shutdown()
    os._exit(code)
