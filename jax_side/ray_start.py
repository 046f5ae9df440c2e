"""Starting Ray for a command: ``start_ray`` connects to a cluster or starts a local one.

Ray is imported when called, not with this module: a cluster the command starts itself listens
on loopback only if the environment is set first (``jax_side.run.prepare_environment``).
"""

from __future__ import annotations

import logging
import os

__all__ = ["start_ray"]

log = logging.getLogger("ingest")


def start_ray(address: str | None, num_cpus: int | None = None) -> None:
    """Connects to ``address`` (or $RAY_ADDRESS), else starts a local cluster on loopback."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    cpus = os.cpu_count() or 1
    if num_cpus is not None and num_cpus > cpus:
        # Each worker takes one CPU: a worker with none would never start.
        log.warning("%d workers on %d CPUs: the local Ray cluster gets %d CPUs so that every "
                    "worker starts, and they share the cores (on the demo, 3 workers on 2 CPUs "
                    "were no faster than 2)", num_cpus, cpus, num_cpus)
    # Listens on 127.0.0.1 only: main() set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before Ray
    # was imported (see prepare_environment).
    ray.init(num_cpus=num_cpus or cpus, include_dashboard=False,
             logging_level=logging.WARNING, configure_logging=True)
