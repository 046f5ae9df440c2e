"""The worker actor's process: CPU only, single-threaded tokenizers, errors as values."""

from __future__ import annotations

import pytest
import ray

from actors.worker import WORKER_ENV, StreamWorker, WorkerError
from ingest import Config, SourceConfig, build_plan
from tests.helpers import write_parquet_corpus

pytestmark = pytest.mark.ray


def test_worker_runs_cpu_only_single_threaded_and_never_imports_jax(ray_cluster, tmp_path):
    write_parquet_corpus(tmp_path, n_files=1, docs_per_file=20, row_group_size=10, seed=1)
    cfg = Config(sources=(SourceConfig(paths=(str(tmp_path),)),), seq_len=16,
                 global_batch_size=2, num_streams=2, unit_rows=5)
    w = StreamWorker.remote(cfg, build_plan(cfg), "probe")
    try:
        ray.get(w.open.remote(0, None), timeout=60)
        chunk = ray.get(w.produce.remote(0, 3), timeout=60)
        assert chunk.num_rows == 3

        env, modules = ray.get(w.__ray_call__.remote(
            lambda self: ({k: __import__("os").environ.get(k) for k in WORKER_ENV},
                          sorted(m for m in __import__("sys").modules
                                 if m.split(".")[0] in ("jax", "jaxlib")))), timeout=60)
        assert env == WORKER_ENV
        assert modules == []
    finally:
        ray.kill(w)


def test_worker_reports_a_stream_that_is_not_open_as_a_value(ray_cluster, tmp_path):
    write_parquet_corpus(tmp_path, n_files=1, docs_per_file=20, row_group_size=10, seed=1)
    cfg = Config(sources=(SourceConfig(paths=(str(tmp_path),)),), seq_len=16,
                 global_batch_size=2, num_streams=2, unit_rows=5)
    w = StreamWorker.remote(cfg, build_plan(cfg), "probe")
    try:
        out = ray.get(w.produce.remote(1, 2), timeout=60)
        assert isinstance(out, WorkerError)
        assert out.stream_id == 1 and out.worker == "probe"
    finally:
        ray.kill(w)
