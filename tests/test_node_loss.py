"""Whole Ray nodes lost mid-run, on Ray's own multi-node test cluster on this machine.

``ray.cluster_utils.Cluster`` starts a head with no CPUs and several 1-CPU worker nodes, each a
raylet with its own object store. Removing the nodes that hold workers kills those workers and
every chunk stored there; the feed must replace them on the nodes left, wait (not fail) while
no CPU is free, and deliver the batches of an unbroken run.

Such a cluster cannot share a process with the tests' session cluster: run as a script
(``python tests/test_node_loss.py child SPEC OUT``) this module is the process that starts it.
Every socket is on 127.0.0.1, Ray's temporary files go to a directory of the child's own, and
every wait has a deadline.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from helpers import write_parquet_corpus

from ingest import Config, SourceConfig, step_digest
from jax_side import HostFeed, batch_sharding

ROOT = Path(__file__).resolve().parents[1]

CHILD_TIMEOUT_S = 300  # the run takes 65-95 s on 2 shared CPUs (4 raylets), a 30 s wait included
MAX_STEPS = 500  # far above the run's length: a feed that never ends fails instead of hanging
FEED = dict(seq_len=32, global_batch_size=16, num_streams=8, num_epochs=2, unit_rows=10,
            chunk_rows=2, prefetch=2)


def feed_config(corpus: Path) -> Config:
    return Config.from_dict({"sources": [SourceConfig(paths=(str(corpus),))], **FEED})


def sharding():
    return batch_sharding(jax.make_mesh((len(jax.devices()),), ("data",)), "data")


def digests(feed: HostFeed, on_step=None) -> list[str]:
    out = []
    for step, batch in enumerate(itertools.islice(feed, MAX_STEPS), 1):
        out.append(step_digest({k: np.asarray(v) for k, v in batch.items()}))
        if on_step is not None:
            on_step(step, feed)
    return out


# -- the child: a multi-node cluster of its own --------------------------------------------------


def _child(spec: dict[str, Any], out: Path) -> None:
    import ray
    from ray.cluster_utils import Cluster

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    loopback = dict(node_ip_address="127.0.0.1", object_store_memory=100 * 2**20)
    cluster = Cluster(initialize_head=True,
                      head_node_args=dict(num_cpus=0, include_dashboard=False, **loopback))
    for _ in range(spec["nodes"]):
        cluster.add_node(num_cpus=1, **loopback)
    cluster.wait_for_nodes(timeout=60)
    ray.init(address=cluster.address, log_to_driver=False)
    removed: list[str] = []
    events: list[str] = []
    added: list[str] = []

    def note(line: str) -> None:
        events.append(line)
        print(line, file=sys.stderr, flush=True)

    def remove_nodes_of(pool) -> None:
        """Removes every node that holds a running worker of ``pool``, with every process on
        it: a worker process can outlive its raylet on this test cluster (small results go
        straight to the caller), where a lost machine takes it along."""
        where = [ray.get(pool.location(w), timeout=30) for w in pool.workers]
        for node in list(cluster.worker_nodes):
            if node.node_id in {n for _, n in where}:
                cluster.remove_node(node, allow_graceful=False)
                removed.append(node.node_id)
        for pid, _ in where:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def on_step(step: int, feed: HostFeed) -> None:
        pool = feed._intake.source
        note(f"step {step}: {pool.num_workers} workers, {pool.num_pending} pending, "
             f"{pool.stats().restarts} restarts")
        if step == spec["remove_at"]:
            remove_nodes_of(pool)
            note(f"removed {len(removed)} node(s) at step {step}")
        elif (spec.get("add_after_s") is not None and step > spec["remove_at"]
              and len(removed) == spec["nodes"] - 1 and pool.num_pending):
            # The streams went on on the nodes left: now lose those too, and bring one node
            # back later. Until then no worker can run anywhere.
            remove_nodes_of(pool)
            note(f"removed the last node(s) at step {step}: {len(removed)} removed")
            commands.put("add a node")

    def consume() -> None:
        try:
            with HostFeed(feed_config(Path(spec["corpus"])), sharding=sharding(),
                          backend="ray", workers=spec["workers"],
                          get_timeout_s=spec["get_timeout_s"]) as feed:
                got = digests(feed, on_step)
                stats = feed.stats()
            commands.put({"digests": got, "removed": removed, "added": added,
                          "events": events, "stats": stats})
        except BaseException as e:  # noqa: BLE001 -- handed to the main thread
            commands.put(e)

    # The feed runs on a thread of its own: Ray starts nodes only on the main thread (it sets
    # signal handlers), which adds the node back while the feed waits for a CPU.
    commands: queue.Queue = queue.Queue()
    threading.Thread(target=consume, name="consumer", daemon=True).start()
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    try:
        while True:
            item = commands.get(timeout=max(1.0, deadline - time.monotonic()))
            if item == "add a node":
                threading.Event().wait(spec["add_after_s"])  # no CPU anywhere meanwhile
                added.append(cluster.add_node(num_cpus=1, **loopback).node_id)
                note(f"added a node {spec['add_after_s']} s after the last one was lost")
                continue
            if isinstance(item, BaseException):
                raise item
            out.write_text(json.dumps(item))
            return
    finally:
        ray.shutdown()
        cluster.shutdown()


def run_child(spec: dict[str, Any], tmp_path: Path) -> tuple[dict[str, Any], str]:
    """Runs ``_child`` in a fresh process; returns what it wrote and its stderr."""
    out, err_path = tmp_path / "out.json", tmp_path / "err.txt"
    # Short: Ray's socket paths live under it (Unix sockets take at most 107 bytes).
    ray_tmp = tempfile.mkdtemp(prefix="rn", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=ray_tmp, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               RAY_AUTH_MODE="disabled", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    with open(err_path, "w") as err:
        p = subprocess.Popen([sys.executable, __file__, "child", json.dumps(spec), str(out)],
                             cwd=ROOT, env=env, stdout=err, stderr=subprocess.STDOUT)
        try:
            p.wait(timeout=CHILD_TIMEOUT_S + 30)
        except subprocess.TimeoutExpired:
            p.terminate()  # Ray's handler stops the cluster's processes
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    shutil.rmtree(ray_tmp, ignore_errors=True)
    text = err_path.read_text()
    assert p.returncode == 0, f"the child exited with {p.returncode}:\n{text[-5000:]}"
    return json.loads(out.read_text()), text


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("nodeloss")
    write_parquet_corpus(d, n_files=3, docs_per_file=120, row_group_size=20, seed=3)
    return d


@pytest.mark.slow
def test_lost_nodes_move_streams_to_the_nodes_left_then_wait_for_a_cpu_and_keep_the_batches(
        corpus, tmp_path):
    """3 one-CPU nodes, 2 workers. At step 5 both nodes holding workers are lost: one
    replacement starts on the third node, the other has no CPU and its streams go to the
    worker running. Then the third node is lost too: no worker can run anywhere, and the feed
    waits (past get_timeout_s, without failing) until a node joins 30 s later. The batches are
    those of an unbroken run."""
    with HostFeed(feed_config(corpus), sharding=sharding(), backend="local") as feed:
        want = digests(feed)
    assert len(want) > 25
    spec = dict(corpus=str(corpus), nodes=3, workers=2, remove_at=5, add_after_s=30,
                get_timeout_s=15)
    got, err = run_child(spec, tmp_path)
    tail = err[-6000:]
    assert len(got["removed"]) == 3 and len(got["added"]) == 1, tail
    assert got["digests"] == want, tail
    stats = got["stats"]
    assert "moving streams" in err and "to the 1 worker(s) running" in err, tail
    assert "no worker runs and no CPU is free" in err, tail
    # At least the wait for the node added back (a replacement first placed on a node being
    # lost can leave no worker running for a while earlier, too).
    assert stats["cpu_waits"] >= 1, tail
    assert stats["cpu_wait_s"] > spec["get_timeout_s"], tail  # it waited, where it once failed
    assert "still no CPU for a worker after" in err, tail
    assert stats["restarts"] >= 3, tail  # one replacement per worker lost
    assert stats["workers"] == 2, tail  # running or still waiting for a CPU


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    _child(json.loads(sys.argv[2]), Path(sys.argv[3]))
