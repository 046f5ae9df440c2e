"""The autoscale policy, and the pool under it: output unchanged, pending workers harmless."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from actors.autoscale import AutoscalePolicy
from ingest import BatchDigest, Config, RuntimeOptions, SourceConfig
from jax_side import HostFeed, batch_sharding
from tests.helpers import write_parquet_corpus


@pytest.mark.parametrize(("wait", "ready", "workers", "expected"), [
    (0.5, 0.0, 2, 3),    # the host waits: grow
    (0.5, 0.0, 4, 4),    # ... but not past max_workers
    (0.0, 1.0, 3, 2),    # chunks sit ready and unused: shrink
    (0.0, 1.0, 1, 1),    # ... but not below min_workers
    (0.05, 0.5, 2, 2),   # neither: stay
    (0.0, 0.5, 2, 2),    # no wait but requests still in flight: stay
])
def test_policy_grows_on_waits_and_shrinks_on_unused_chunks(wait, ready, workers, expected):
    policy = AutoscalePolicy(min_workers=1, max_workers=4)
    assert policy.decide(workers=workers, wait_fraction=wait, ready_fraction=ready) == expected


def test_policy_waits_one_window_after_a_change():
    policy = AutoscalePolicy(min_workers=1, max_workers=8)
    assert policy.decide(workers=2, wait_fraction=0.9, ready_fraction=0.0) == 3
    assert policy.decide(workers=3, wait_fraction=0.9, ready_fraction=0.0) == 3
    assert policy.decide(workers=3, wait_fraction=0.9, ready_fraction=0.0) == 4


@pytest.mark.ray
@pytest.mark.slow
def _sharding():
    return batch_sharding(jax.make_mesh((len(jax.devices()),), ("data",)), "data")


def digest(feed) -> str:
    """The digest of every batch ``feed`` gives."""
    d = BatchDigest()
    for batch in feed:
        d.update({k: np.asarray(v) for k, v in batch.items()})
    return d.hexdigest()


def test_autoscaled_pool_with_pending_workers_gives_the_unbroken_batches(ray_cluster,
                                                                         tmp_path):
    # Enough data for several autoscale windows after the first chunk, however fast one worker
    # is (the whole run took under one 0.2 s window once the worker got faster).
    write_parquet_corpus(tmp_path, n_files=3, docs_per_file=300, row_group_size=20, seed=8)
    # max_workers=8 on a 4-CPU test cluster: some grown workers can never start. They must
    # stay pending without stalling any stream.
    cfg = Config(sources=(SourceConfig(paths=(str(tmp_path),)),), seq_len=32,
                 global_batch_size=16, num_streams=8, num_epochs=1, unit_rows=10,
                 runtime=RuntimeOptions(chunk_rows=2, workers=1, autoscale=True, min_workers=1,
                                        max_workers=8, autoscale_window_s=0.05))
    sharding = _sharding()
    with HostFeed(cfg, sharding=sharding, backend="local") as feed:
        expected = digest(feed)
    with HostFeed(cfg, sharding=sharding, backend="ray") as feed:
        got = digest(feed)
        grown = feed._intake.source.stats().resizes
    assert got == expected
    assert grown >= 1, "the host waited on one worker, so the pool should have grown"


def test_workers_beyond_the_cluster_cpus_start_pending_and_the_batches_are_unchanged(
        ray_cluster, tmp_path, caplog):
    import ray

    write_parquet_corpus(tmp_path, n_files=2, docs_per_file=60, row_group_size=20, seed=9)
    # Two more workers than the 4-CPU test cluster has CPUs: before, opening the streams
    # waited for workers that could never start, until the 300 s timeout.
    asked = int(ray.cluster_resources()["CPU"]) + 2
    cfg = Config(sources=(SourceConfig(paths=(str(tmp_path),)),), seq_len=32,
                 global_batch_size=16, num_streams=8, num_epochs=1, unit_rows=10,
                 runtime=RuntimeOptions(chunk_rows=2, workers=asked))
    sharding = _sharding()
    with HostFeed(cfg, sharding=sharding, backend="local") as feed:
        expected = digest(feed)
    with caplog.at_level("WARNING", logger="ingest.pool"):
        # Bounded: without pending workers, opening the streams times out instead.
        with HostFeed(cfg, sharding=sharding, backend="ray", get_timeout_s=60) as feed:
            got = digest(feed)
            pool = feed._intake.source
            pending = pool.num_pending
            stats = feed.stats()
    assert got == expected
    assert pending >= 2, f"{asked} workers on {asked - 2} CPUs: at least 2 should wait"
    assert stats["workers"] == asked and stats["pending_workers"] == pending
    assert pool.num_pending == 0 and pool.num_workers == 0, "close() must end pending workers too"
    assert any(f"workers={asked}, but the Ray cluster has" in r.getMessage()
               for r in caplog.records)
