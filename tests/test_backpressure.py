"""Object-store memory held by the feed stays under object_store_budget_mb."""

from __future__ import annotations

import gc
import re
import threading
import time

import jax
import pytest
from ray._private import internal_api
from ray._private import state as ray_state

from ingest import Config, SourceConfig
from jax_side import HostFeed, batch_sharding
from tests.helpers import write_parquet_corpus

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _plasma_bytes(address: str) -> int:
    # The address matters: other Ray clusters may run on this machine at the same time.
    text = internal_api.memory_summary(address=address, stats_only=True)
    m = re.search(r"Plasma memory usage (\d+) MiB", text)
    assert m, f"no plasma usage in Ray's memory summary:\n{text[-1000:]}"
    return int(m.group(1)) * 2**20


def _settled_plasma_bytes(address: str, timeout_s: float = 30.0) -> int:
    """The store's usage once earlier tests' objects are gone: their reference cycles are
    collected, their actors have died, and readings over 2 s agree. Objects freed while the
    feed runs would hide the feed's own bytes."""
    gc.collect()
    deadline = time.monotonic() + timeout_s
    wait = threading.Event()
    while time.monotonic() < deadline and any(
            a["State"] != "DEAD" for a in ray_state.actors().values()):
        wait.wait(0.25)
    readings = [_plasma_bytes(address)]
    while time.monotonic() < deadline:
        wait.wait(0.5)
        readings = [*readings[-3:], _plasma_bytes(address)]
        if len(readings) == 4 and len(set(readings)) == 1:
            break
    return readings[-1]


def _config(tmp_path, **kw) -> Config:
    write_parquet_corpus(tmp_path, n_files=2, docs_per_file=200, row_group_size=25, seed=5)
    fields = dict(sources=(SourceConfig(paths=(str(tmp_path),)),), seq_len=1024,
                  global_batch_size=16, num_streams=8, num_epochs=None, unit_rows=25,
                  chunk_rows=16, prefetch=8, workers=2)
    fields.update(kw)
    return Config.from_dict(fields)


def test_object_store_stays_under_the_budget_while_the_consumer_pauses(ray_cluster, tmp_path):
    # One chunk is 6 x 16 x 1024 x 4 B = 384 KiB; 8 streams x (prefetch 8 + 1) would be 27 MiB.
    cfg = _config(tmp_path, object_store_budget_mb=8)
    sharding = batch_sharding(jax.make_mesh((len(jax.devices()),), ("data",)), "data")
    baseline = _settled_plasma_bytes(ray_cluster)
    with HostFeed(cfg, sharding=sharding, backend="ray") as feed:
        for _, _ in zip(range(3), feed, strict=False):
            pass
        # Paused for 10 s: workers fill every request they are allowed, then stop.
        peak = 0
        paused = threading.Event()
        for _ in range(20):
            paused.wait(0.5)
            peak = max(peak, _plasma_bytes(ray_cluster) - baseline)
        for _, _ in zip(range(3), feed, strict=False):
            pass
        stats = feed.stats()
    after = _settled_plasma_bytes(ray_cluster)
    assert stats["object_store_bytes_bound"] <= 8 * 2**20
    assert 0 < stats["object_store_bytes_peak"] <= stats["object_store_bytes_bound"]
    # Ray reports whole MiB; the plan object and rounding get 1 MiB of slack.
    assert peak <= 8 * 2**20 + 2**20, f"object store held {peak / 2**20:.1f} MiB"
    assert peak > 2**20, (
        f"the paused feed should have filled part of its budget; the store held "
        f"{baseline / 2**20:.0f} MiB before the feed and {after / 2**20:.0f} MiB after it")


def test_a_budget_below_one_chunk_per_stream_is_refused_with_the_minimum(tmp_path):
    cfg = _config(tmp_path, object_store_budget_mb=1)
    sharding = batch_sharding(jax.make_mesh((len(jax.devices()),), ("data",)), "data")
    with pytest.raises(ValueError, match=r"object_store_budget_mb=1 is below the 3\.5 MB"):
        HostFeed(cfg, sharding=sharding, backend="ray")
