"""The Ray cluster that ``ingest run`` starts: it listens on loopback only, and frees objects
as soon as they are released."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

PROBE = r"""
import argparse, json, psutil
from jax_side.run import prepare_environment, start_ray
args = argparse.Namespace(address=None)
prepare_environment(args)          # what main() does first
start_ray(None, num_cpus=1)
import ray
me = psutil.Process()
addrs = set()
for p in [me] + me.children(recursive=True):
    try:
        for c in p.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN:
                addrs.add(c.laddr.ip)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass
from ray._private import state
config = state.state.get_system_config()   # what the GCS and the raylet run with
ray.shutdown()
print(json.dumps({"listening": sorted(addrs), "system_config": config}))
"""


@pytest.fixture(scope="module")
def probe() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")
           and not k.startswith("RAY_free_objects")}
    env["RAY_AUTH_MODE"] = "disabled"
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_cluster_that_ingest_run_starts_listens_on_loopback_only(probe):
    addrs = probe["listening"]
    assert addrs, "found no listening socket: the probe is broken"
    assert set(addrs) <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}, f"Ray listens on {addrs}"


def test_a_cluster_that_ingest_run_starts_deletes_each_released_object_at_once(probe):
    # Ray's default deletes released objects once a second or every 100 of them: up to a
    # second of chunks in the store beyond the feed's object_store_bytes_bound.
    assert probe["system_config"].get("free_objects_period_milliseconds") == 0, (
        f"the local cluster's system config: {probe['system_config']}")
