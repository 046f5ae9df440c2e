"""Joining the JAX processes of a run: with ``--coordinator``/``--num-hosts``/``--host-id``,
or through ``jax.distributed.initialize()``'s own cluster detection (Cloud TPU pods,
Kubernetes, SLURM, Open MPI); and leaving at once when a run fails.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import jax

from jax_side.private_api import cluster_types

# How long process 0 stays after its error before it leaves (see ``leave``).
LEADER_GRACE_S = 2.0

__all__ = ["ClusterJoinError", "detected_cluster", "initialize", "leave"]

log = logging.getLogger("ingest.multihost")


class ClusterJoinError(RuntimeError):
    """This process could not join the JAX processes of the cluster environment it is in."""


def detected_cluster() -> tuple[str, int | None] | None:
    """The cluster environment ``jax.distributed.initialize()`` would detect here, through
    JAX's own cluster classes (Cloud TPU, Kubernetes, SLURM, Open MPI, ...; not the opt-in
    mpi4py), and its process count (None if the environment cannot tell it without joining);
    None when there is none."""
    try:
        kinds = cluster_types()
    except (ImportError, AttributeError) as e:
        log.warning("cannot list JAX's cluster environments (%s); without --coordinator the "
                    "processes join only when jax.distributed.initialize() finds one", e)
        return None
    for kind in kinds:
        if kind.opt_in_only_method:
            continue
        try:
            if not kind.is_env_present():
                continue
        except Exception as e:  # noqa: BLE001 -- a probe that fails means "not here"
            log.debug("JAX cluster probe %s failed: %s", kind.__name__, e)
            continue
        try:
            count: int | None = int(kind.get_process_count())
        except Exception as e:  # noqa: BLE001 -- jax.distributed.initialize() will say why
            log.debug("%s cannot tell the process count before joining: %s", kind.__name__, e)
            count = None
        return kind.__name__, count
    return None


def initialize(coordinator: str | None, num_hosts: int | None, host_id: int | None) -> None:
    """Joins this process to the others with ``jax.distributed.initialize``, before anything
    touches a JAX device: with the three values from the command line, else with no arguments
    (JAX's own cluster detection) when JAX detects a cluster environment of several
    processes; else does nothing.

    Raises:
      ClusterJoinError: a cluster environment was detected but joining failed (naming it), or
        ``JAX_COORDINATOR_ADDRESS`` is set where no environment gives the process count and id.
    """
    if jax.distributed.is_initialized():
        return
    if coordinator is not None:
        log.info("joining %d JAX processes as process %d through %s", num_hosts, host_id,
                 coordinator)
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_hosts,
                                   process_id=host_id)
        return
    found = detected_cluster()
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if found is None:
        if address:
            raise ClusterJoinError(
                f"JAX_COORDINATOR_ADDRESS={address} is set, but no cluster environment JAX "
                f"detects (Cloud TPU, Kubernetes, SLURM, Open MPI) gives this process's count "
                f"and id. Start the processes under one of them, or pass --coordinator "
                f"{address} --num-hosts N --host-id I")
        return
    name, count = found
    if count is not None and count <= 1:
        log.info("cluster environment %s shows one process: running as a single host", name)
        return
    log.info("cluster environment %s (%s processes): joining through "
             "jax.distributed.initialize()", name, count if count is not None else "?")
    try:
        jax.distributed.initialize()
    except (ValueError, TypeError, RuntimeError) as e:
        raise ClusterJoinError(
            f"jax.distributed.initialize() failed in the cluster environment {name} that JAX "
            f"detected: {e}. Fix the environment, or pass --coordinator HOST:PORT --num-hosts N "
            f"--host-id I") from e


def leave(code: int) -> None:
    """Exits this process after flushing its output (process 0 after a short grace).

    A process of a failed multi-process run must not linger: at a normal exit,
    ``jax.distributed`` waits at a shutdown barrier (up to 5 minutes) for every process, while
    those wait for this one in their next collective. Leaving closes its sockets, so the peers'
    collectives fail within milliseconds and they report it. Process 0 holds the coordination
    service, whose end aborts every peer: it waits ``LEADER_GRACE_S`` first, so that peers
    meeting the same error at start (a config, a mesh) name it themselves.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if jax.distributed.is_initialized() and jax.process_count() > 1 and jax.process_index() == 0:
        time.sleep(LEADER_GRACE_S)
    logging.shutdown()
    os._exit(code)
