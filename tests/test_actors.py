"""The worker actor's process: CPU only, single-threaded tokenizers, errors as values."""

from __future__ import annotations

import pytest
import ray

from actors.worker import WORKER_ENV, StreamWorker, WorkerError, actor_class
from ingest import Config, RuntimeOptions, SourceConfig, build_plan
from tests.helpers import write_parquet_corpus

pytestmark = pytest.mark.ray


def test_worker_runs_cpu_only_single_threaded_and_never_imports_jax(ray_cluster, tmp_path):
    write_parquet_corpus(tmp_path, n_files=1, docs_per_file=20, row_group_size=10, seed=1)
    cfg = Config(sources=(SourceConfig(paths=(str(tmp_path),)),), seq_len=16,
                 global_batch_size=2, num_streams=2, unit_rows=5)
    w = actor_class(StreamWorker).remote(cfg, build_plan(cfg), "probe")
    try:
        ray.get(w.open.remote(0, None), timeout=60)
        chunk = ray.get(w.produce.remote(0, 3), timeout=60)
        assert chunk.num_rows == 3

        env, modules = ray.get(w.__ray_call__.remote(
            lambda self: ({k: __import__("os").environ.get(k) for k in WORKER_ENV},
                          sorted(m for m in __import__("sys").modules
                                 if m.split(".")[0] in ("jax", "jaxlib", "pandas")))),
            timeout=60)
        assert env == WORKER_ENV
        # No JAX; no pandas either: pyarrow's to_numpy/pa.array/pa.scalar pull it
        # in (0.25 s and 48 MB per worker), ingest reads Arrow buffers instead.
        assert modules == []
    finally:
        ray.kill(w)


def test_worker_reports_a_stream_that_is_not_open_as_a_value(ray_cluster, tmp_path):
    write_parquet_corpus(tmp_path, n_files=1, docs_per_file=20, row_group_size=10, seed=1)
    cfg = Config(sources=(SourceConfig(paths=(str(tmp_path),)),), seq_len=16,
                 global_batch_size=2, num_streams=2, unit_rows=5)
    w = actor_class(StreamWorker).remote(cfg, build_plan(cfg), "probe")
    try:
        out = ray.get(w.produce.remote(1, 2), timeout=60)
        assert isinstance(out, WorkerError)
        assert out.stream_id == 1 and out.worker == "probe"
    finally:
        ray.kill(w)


@pytest.mark.slow
@pytest.mark.skipif(tuple(int(x) for x in ray.__version__.split(".")[:2]) < (2, 60),
                    reason="the feed's metrics reach Ray's Prometheus endpoint from Ray 2.60 (at the "
                           "floor, Ray 2.40, the host's do not); feed.stats() has them on any Ray")
def test_feed_metrics_reach_rays_prometheus_endpoint_and_stats(ray_cluster, tmp_path):
    import threading
    import time
    import urllib.request

    import jax

    from jax_side import HostFeed, batch_sharding

    write_parquet_corpus(tmp_path, n_files=2, docs_per_file=60, row_group_size=10, seed=2)
    cfg = Config(sources=(SourceConfig(paths=(str(tmp_path),)),), seq_len=32,
                 global_batch_size=16, num_streams=8, unit_rows=5, num_epochs=None,
                 runtime=RuntimeOptions(workers=2))
    sharding = batch_sharding(jax.make_mesh((len(jax.devices()),), ("data",)), "data")
    with HostFeed(cfg, sharding=sharding, backend="ray") as feed:
        for _, _ in zip(range(20), feed, strict=False):
            pass
        stats = feed.stats()
    assert set(stats["rows_per_s_by_stream"]) == {str(s) for s in range(8)}
    assert all(r > 0 for r in stats["rows_per_s_by_stream"].values())
    assert len(stats["rows_per_s_by_worker"]) == 2

    port = ray._private.worker.global_worker.node.metrics_export_port
    wanted = {"ray_ingest_rows_received_total", "ray_ingest_worker_rows_total",
              "ray_ingest_queue_depth", "ray_ingest_chunk_wait_seconds_total"}
    found: set[str] = set()
    deadline = time.monotonic() + 60  # Ray reports metrics every few seconds
    tick = threading.Event()
    while not wanted <= found and time.monotonic() < deadline:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        found = {line.split("{")[0].split(" ")[0] for line in body.decode().splitlines()
                 if line.startswith("ray_ingest_")}
        tick.wait(1.0)
    assert wanted <= found, f"missing metrics after 60 s: {sorted(wanted - found)}"


def test_workers_bind_to_cpus_of_their_own_unless_told_not_to(ray_cluster, tmp_path):
    import fcntl
    import os
    import tempfile

    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs CPU affinity and 2 CPUs")
    write_parquet_corpus(tmp_path, n_files=1, docs_per_file=20, row_group_size=10, seed=1)
    cfg = Config(sources=(SourceConfig(paths=(str(tmp_path),)),), seq_len=16,
                 global_batch_size=2, num_streams=2, unit_rows=5)
    plan = build_plan(cfg)

    def probe(self):
        # A pinned worker runs on one CPU; one that claimed none (or is not pinned), on all.
        affinity = sorted(__import__("os").sched_getaffinity(0))
        return (affinity[0] if len(affinity) == 1 else None), affinity

    everything = sorted(os.sched_getaffinity(0))
    ws = [actor_class(StreamWorker).remote(cfg, plan, f"pin{i}") for i in range(2)]
    try:
        got = ray.get([w.__ray_call__.remote(probe) for w in ws], timeout=60)
        claimed = [cpu for cpu, _ in got if cpu is not None]
        assert len(set(claimed)) == len(claimed), got  # never the same CPU
        for cpu, affinity in got:
            assert affinity == ([cpu] if cpu is not None else everything), got
        if len(claimed) < 2:
            # Only when every CPU was held (by workers of other tests still exiting): check.
            locks = os.path.join(tempfile.gettempdir(), f"ingest-cpus-{os.getuid()}")
            for cpu in everything:
                with open(os.path.join(locks, f"cpu{cpu}.lock"), "a") as f:
                    with pytest.raises(OSError):
                        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        for w in ws:
            ray.kill(w)
    floating = actor_class(StreamWorker).remote(cfg.replace(pin_workers=False), plan, "f")
    try:
        assert ray.get(floating.__ray_call__.remote(probe), timeout=60) == (None, everything)
    finally:
        ray.kill(floating)


def test_workers_map_the_first_pages_of_the_object_store_unless_told_not_to(ray_cluster,
                                                                            tmp_path):
    from actors.pool import WorkerPool

    write_parquet_corpus(tmp_path, n_files=1, docs_per_file=20, row_group_size=10, seed=1)
    cfg = Config(sources=(SourceConfig(paths=(str(tmp_path),)),), seq_len=256,
                 global_batch_size=4, num_streams=2, unit_rows=5,
                 runtime=RuntimeOptions(chunk_rows=64))
    plan = build_plan(cfg)

    class PrefaultProbe(StreamWorker):
        """Keeps the bytes its prefault thread mapped."""

        def _prefault_store(self, nbytes: int) -> int:
            self.mapped = super()._prefault_store(nbytes)
            return self.mapped

    def probe(self):
        import os

        from ingest.stream.process import prefault_shared, shared_mapping

        self._prefault.join(60)
        prefaulted = self.mapped
        found = shared_mapping("plasma")
        if found is None:
            return prefaulted, None, False
        with open(f"/proc/{os.getpid()}/smaps") as f:
            lines = f.read().splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith(f"{found[0]:x}-"))
        rss = next(int(line.split()[1]) for line in lines[at:] if line.startswith("Rss:"))
        # Whether this machine can prefault at all (tmpfs store, Linux 5.14+): one page.
        return prefaulted, rss * 1024, prefault_shared("plasma", 1) > 0

    for on in (True, False):
        pool = WorkerPool(cfg.replace(prefault_object_store=on), plan, [0, 1],
                          num_workers=2, get_timeout_s=60, worker_cls=PrefaultProbe)
        try:
            # Two streams, three chunks each of 64 x 256 tokens of 14 bytes (two int32 token
            # fields, three uint16 layout ones; 0.22 MiB): 1.3 MiB.
            assert pool.bytes_bound == 3 * 2 * 64 * 256 * 14
            got = ray.get([w.__ray_call__.remote(probe) for w in pool.workers], timeout=60)
        finally:
            pool.close()
        for prefaulted, resident, supported in got:
            if not on:
                assert prefaulted == 0
            elif not supported:
                pytest.skip("no tmpfs object store, or a kernel before 5.14: nothing prefaulted")
            else:
                page = __import__("os").sysconf("SC_PAGE_SIZE")
                assert prefaulted == -(-pool.bytes_bound * 5 // 4 // page) * page
                assert resident >= prefaulted


def test_pool_workers_follow_the_hosts_cache_settings(ray_cluster, tmp_path, monkeypatch):
    """INGEST_CACHE_DIR and INGEST_ROW_GROUP_CACHE_GB set where the pool is made reach its
    workers, which Ray starts from its own environment (on other nodes too)."""
    from actors.pool import WorkerPool
    from actors.worker import HOST_ENV

    write_parquet_corpus(tmp_path / "data", n_files=1, docs_per_file=20, row_group_size=10,
                         seed=1)
    cfg = Config(sources=(SourceConfig(paths=(str(tmp_path / "data"),)),), seq_len=16,
                 global_batch_size=2, num_streams=2, unit_rows=5)
    plan = build_plan(cfg)
    want = {"INGEST_CACHE_DIR": str(tmp_path / "cache"), "INGEST_ROW_GROUP_CACHE_GB": "2.5"}
    assert set(want) == set(HOST_ENV)
    for k, v in want.items():
        monkeypatch.setenv(k, v)
    pool = WorkerPool(cfg, plan, [0, 1], num_workers=2, get_timeout_s=60)
    try:
        got = ray.get([w.__ray_call__.remote(
            lambda self: ({k: __import__("os").environ.get(k) for k in HOST_ENV},
                          __import__("ingest.sources.spill").sources.spill.budget_bytes()))
            for w in pool.workers], timeout=60)
    finally:
        pool.close()
    assert got == [(want, int(2.5 * 2**30))] * 2
