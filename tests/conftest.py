"""Shared fixtures: one Ray cluster for the session, on loopback, and 8 forced CPU devices.

The environment must be set before JAX or Ray start: 8 CPU devices for the
multidevice tests, every Ray socket on 127.0.0.1, and token authentication off for this
loopback-only test cluster (real clusters keep it on; see docs/operations.md).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ.setdefault("INGEST_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache"))

import pytest  # noqa: E402

# Logical CPUs for the test cluster: tests run up to 3 single-CPU workers on a 2-CPU machine.
TEST_CLUSTER_CPUS = 4


@pytest.fixture(scope="session")
def ray_cluster():
    """Starts Ray once per session; yields the GCS address subprocesses can join."""
    import ray

    if not ray.is_initialized():
        # address="local": a cluster of the tests' own, never one a `ray start` left running.
        ray.init(address="local", num_cpus=TEST_CLUSTER_CPUS, include_dashboard=False,
                 log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
