"""The one place the benchmarks use a private Ray API, with a public fallback.

``raylet_channel`` opens a gRPC channel to a raylet the way Ray's own ``ray memory`` does
(``ray._private.grpc_utils.init_grpc_channel``: Ray's channel options and, in token auth mode,
its credentials), so that ``benchmarks.measure`` can poll the object store's size without a
minute-long GCS query while the cluster starts. Without that function (another Ray), it is a
plain ``grpc.insecure_channel``, enough for a cluster without auth; the poll then fails and the
measurement records the object store as unknown.
"""

from __future__ import annotations

__all__ = ["raylet_channel"]


def raylet_channel(address: str):
    """A gRPC channel to ``address`` (``host:port``) as Ray opens one."""
    try:
        from ray._private.grpc_utils import init_grpc_channel  # noqa: PLC0415
    except ImportError:
        import grpc  # noqa: PLC0415

        return grpc.insecure_channel(address)
    return init_grpc_channel(address)
