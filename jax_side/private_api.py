"""The one place the host feed uses a private JAX API, with a public fallback.

``coordination_client`` is JAX's client of the coordination service that
``jax.distributed.initialize`` starts (``jax._src.distributed.global_state.client``): its
key-value store lets a host that timed out waiting for the others name the processes that never
arrived. JAX offers no public handle on it; without it the error cannot name them.

Ray's private APIs go through ``actors.private_api``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["coordination_client"]


def coordination_client() -> Any | None:
    """JAX's client of the coordination service (``key_value_set``, ``key_value_dir_get``,
    ``key_value_delete``), or None when this process joined none or this JAX keeps it
    elsewhere."""
    try:
        from jax._src import distributed  # noqa: PLC0415
    except ImportError:
        return None
    return getattr(getattr(distributed, "global_state", None), "client", None)
