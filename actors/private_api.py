"""The one place the actors use private Ray APIs, each with a public fallback.

``ray_auto_address`` resolves ``--address=auto`` the way ``ray.init`` does, so that a dead
cluster is reported in seconds; without it the address goes to ``ray.init`` unchecked.

``init_local_ray`` starts a local Ray cluster with Ray's underscore arguments of ``ray.init``:
``_temp_dir`` (its sessions, sockets and address file in a directory of its own) and
``_system_config``. A Ray that no longer takes them gets the public arguments alone, with a
warning: the cluster then uses Ray's default temporary directory and settings.

``ray_worker_logger`` is the logger of Ray's driver (``ray._private.worker``), so that one of
its warnings can be filtered; under another name the filter is on a logger nobody uses and the
warning shows.

Nothing here imports Ray at module level: the helpers run on the thread that starts Ray while
the main thread imports JAX.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["init_local_ray", "ray_auto_address", "ray_worker_logger"]

log = logging.getLogger(__name__)


def ray_auto_address() -> str | None:
    """The cluster ``ray.init(address="auto")`` would join: the last ``ray start`` on this
    machine (Ray's ``ray_current_cluster`` file), else a GCS process running here; None when
    this Ray keeps that lookup elsewhere.

    Raises:
      ConnectionError: no cluster is found (Ray's own error).
    """
    try:
        from ray._private.services import get_ray_address_from_environment  # noqa: PLC0415
    except ImportError:
        return None
    return get_ray_address_from_environment("auto", None)


def init_local_ray(init: Callable[..., Any], *, temp_dir: str, system_config: dict[str, Any],
                   **kwargs: Any) -> None:
    """Calls ``init`` (``ray.init`` or a wrapper that passes its arguments on) with ``kwargs``
    and Ray's ``_temp_dir=temp_dir`` and ``_system_config=system_config``.

    A Ray whose ``ray.init`` rejects them (it raises before starting anything) gets ``kwargs``
    alone, with a warning.
    """
    try:
        init(**kwargs, _temp_dir=temp_dir, _system_config=system_config)
    except RuntimeError as e:
        if "Unknown keyword argument" not in str(e):
            raise
        log.warning("this Ray's ray.init takes neither _temp_dir nor _system_config (%s): the "
                    "local cluster uses Ray's default temporary directory and settings", e)
        init(**kwargs)


def ray_worker_logger() -> logging.Logger:
    """The logger Ray's driver warns on (its ``ray._private.worker`` module)."""
    return logging.getLogger("ray._private.worker")
