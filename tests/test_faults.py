"""Worker deaths: SIGKILL real worker processes mid-run and at every phase of a pool's life;
the batches must not change."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
import ray

from actors import faults
from actors.pool import WorkerPool
from ingest import BatchDigest, Config, RuntimeOptions, SourceConfig, StreamError, build_plan
from ingest.stream.kinds import Stream
from jax_side import HostFeed, batch_sharding
from tests.helpers import (
    dying_worker,
    failing_worker,
    poisoned_worker,
    read_streams,
    write_parquet_corpus,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults")
    write_parquet_corpus(d, n_files=3, docs_per_file=120, row_group_size=20, seed=3)
    return d


def _config(corpus, **kw) -> Config:
    fields = dict(sources=(SourceConfig(paths=(str(corpus),)),), seq_len=32,
                  global_batch_size=16, num_streams=8, num_epochs=2, unit_rows=10,
                  chunk_rows=2, prefetch=2, workers=2)
    fields.update(kw)
    return Config.from_dict(fields)


def _digests(feed: HostFeed, on_step=None) -> list[str]:
    out = []
    for i, batch in enumerate(feed):
        d = BatchDigest()
        d.update({k: np.asarray(v) for k, v in batch.items()})
        out.append(d.hexdigest())
        if on_step is not None:
            on_step(i, feed)
    return out


def _sharding():
    return batch_sharding(jax.make_mesh((len(jax.devices()),), ("data",)), "data")


@pytest.mark.parametrize("streams_per_call", [1, 4])
def test_sigkilled_workers_are_replaced_and_batches_do_not_change(ray_cluster, corpus,
                                                                 streams_per_call):
    cfg = _config(corpus, streams_per_call=streams_per_call)
    with HostFeed(cfg, sharding=_sharding(), backend="local") as feed:
        expected = _digests(feed)
    assert len(expected) > 20

    killed = []
    rng = np.random.default_rng(0)

    def kill_some(step, feed):
        if step % 7 == 3:
            what = faults.kill_random_worker(feed._intake.source, rng)  # SIGKILL, as the OOM killer
            assert what is not None, "no worker to kill"
            killed.append(what)

    with HostFeed(cfg, sharding=_sharding(), backend="ray", workers=2) as feed:
        got = _digests(feed, kill_some)
        restarts = feed._intake.source.stats().restarts
    assert got == expected
    assert len(killed) >= 3
    assert restarts >= len(killed) - 1  # a kill may land while its worker idles at the end


@pytest.mark.parametrize("streams_per_call", [1, 2])
def test_resize_up_and_down_mid_run_does_not_change_batches(ray_cluster, corpus,
                                                            streams_per_call):
    cfg = _config(corpus, num_epochs=2, streams_per_call=streams_per_call)
    with HostFeed(cfg, sharding=_sharding(), backend="local") as feed:
        expected = _digests(feed)
    # At most 3 workers: the session cluster has 4 CPUs, and other tests may hold one.
    sizes = {2: 3, 10: 1, 18: 3, 26: 2}
    assert len(expected) > 30
    started = []
    step_time = threading.Event()

    def resize(step, feed):
        pool = feed._intake.source
        now = pool.stats()
        started.append((now.num_workers, now.num_pending))
        if now.num_pending:
            # Let pending workers start (bounded), so the next steps see them take streams.
            refs = [pool.location(w) for w in pool.pending_workers]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=60)
            assert len(ready) == len(refs), "a new worker did not start within 60 s"
        if step in sizes:
            feed.resize(sizes[step])
        step_time.wait(0.05)  # a training step

    with HostFeed(cfg, sharding=_sharding(), backend="ray", workers=2) as feed:
        got = _digests(feed, resize)
        end = feed._intake.source.stats()
        assert end.resizes == len(sizes)
        # Workers take streams once started; the last one may still be starting at the end.
        assert end.num_workers + end.num_pending == 2
    assert got == expected
    assert max(w for w, _ in started) >= 3 and min(w for w, _ in started) == 1, str(started)


def test_resize_is_refused_for_the_local_backend(corpus):
    with HostFeed(_config(corpus), sharding=_sharding(), backend="local") as feed:
        with pytest.raises(ValueError, match="backend='ray'"):
            feed.resize(2)


def _unbroken(cfg, plan, streams) -> dict[int, np.ndarray]:
    """Each stream's rows made in this process, in one go."""
    return {s: Stream(cfg, plan, s).produce(100_000).fields for s in streams}


def _digest(rows: dict[int, np.ndarray]) -> str:
    d = BatchDigest()
    d.update({f"stream {s}": rows[s] for s in sorted(rows)})
    return d.hexdigest()


@pytest.mark.parametrize("streams_per_call", [1, 4])
def test_a_worker_that_raises_mid_chunk_is_replaced_and_batches_do_not_change(
        ray_cluster, corpus, streams_per_call, tmp_path):
    cfg = _config(corpus, num_epochs=1, streams_per_call=streams_per_call)
    plan = build_plan(cfg)
    # Odd, so the failure lands mid-chunk (chunk_rows=2); past the first requests in flight.
    at = (cfg.runtime.prefetch + 3) * cfg.runtime.chunk_rows + 1
    pool = WorkerPool(cfg, plan, list(range(8)), num_workers=2, get_timeout_s=60,
                      worker_cls=failing_worker(5, at, str(tmp_path / "failed")))
    try:
        pool.open({s: (None, 0) for s in range(8)})
        got = read_streams(pool, range(8))
        stats = pool.stats()
    finally:
        pool.close()
    assert (tmp_path / "failed").exists(), "the injected error never ran"
    assert _digest(got) == _digest(_unbroken(cfg, plan, range(8)))
    assert stats.restarts == 1


def test_a_stream_that_keeps_failing_stops_with_an_error_naming_file_and_row(ray_cluster,
                                                                             corpus):
    cfg = _config(corpus, num_epochs=1, chunk_rows=2, prefetch=1)
    plan = build_plan(cfg)
    # A fault at every attempt at the same position: what a poison document looks like.
    pool = WorkerPool(cfg, plan, list(range(8)), num_workers=1, get_timeout_s=60,
                      worker_cls=failing_worker(3, 3))
    try:
        pool.open({s: (None, 0) for s in range(8)})
        first = pool.next_chunk(3)
        expected = Stream(cfg, plan, 3)
        expected.set_state(first.state_after)
        where = expected.describe_head()
        with pytest.raises(StreamError) as e:
            for _ in range(2 * pool.recovery.max_failures):
                pool.next_chunk(3)
        assert f"stream 3 failed {pool.recovery.max_failures} times" in str(e.value)
        assert where in str(e.value)
        assert str(corpus) in where and " row " in where
    finally:
        pool.close()


@pytest.mark.parametrize("streams_per_call", [1, 2])
def test_a_document_that_kills_its_workers_is_located_and_skipped_by_config(ray_cluster,
                                                                            tmp_path,
                                                                            streams_per_call):
    """on_bad_document: skip: a document whose tokenizing kills the worker process every time
    is located (traced on a disposable worker), skipped and counted as worker_crash; every
    other row is as if that document were a null text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ingest.plan.deal import deal_units
    from ingest.stream.kinds import Stream
    from tests.helpers import make_texts

    marker = "POISON-7f3a"
    texts = [make_texts(40, seed=20 + i) for i in range(2)]
    texts[1][13] = texts[1][13] + " " + marker
    for name, null in (("poisoned", False), ("nulled", True)):
        (tmp_path / name).mkdir()
        for i, t in enumerate(texts):
            col = [None if (null and i == 1 and j == 13) else x for j, x in enumerate(t)]
            pq.write_table(pa.table({"text": pa.array(col, pa.string())}),
                           tmp_path / name / f"part-{i}.parquet", row_group_size=10)
    cfg = _config(tmp_path / "poisoned", num_epochs=1, num_streams=4, global_batch_size=8,
                  on_bad_document="skip", chunk_rows=2, prefetch=1,
                  streams_per_call=streams_per_call)
    ref_cfg = _config(tmp_path / "nulled", num_epochs=1, num_streams=4, global_batch_size=8,
                      on_bad_document="skip", chunk_rows=2, prefetch=1)
    plan, ref_plan = build_plan(cfg), build_plan(ref_cfg)
    deal = dict(num_streams=4, seed=cfg.seed, epoch=0, shuffle=True)
    assert ([d.tolist() for d in deal_units(plan, **deal)]
            == [d.tolist() for d in deal_units(ref_plan, **deal)]), "precondition: same deal"

    pool = WorkerPool(cfg, plan, list(range(4)), num_workers=2, get_timeout_s=60,
                      worker_cls=poisoned_worker(marker))
    try:
        pool.open({s: (None, 0) for s in range(4)})
        for s in range(4):
            rows, last = [], None
            while last is None or not last.exhausted:
                last = pool.next_chunk(s)
                rows.append(last.fields)
            got = np.concatenate(rows, axis=1)
            ref = Stream(ref_cfg, ref_plan, s)
            want = ref.produce(10_000).fields
            np.testing.assert_array_equal(got, want, err_msg=f"stream {s}")
            crashed = last.state_after["skipped"].get("worker_crash", {})
            nulled = ref.get_state()["skipped"].get("null_text", {})
            assert sum(crashed.values()) == sum(nulled.values())
        assert pool.stats().poisoned == 1
        assert pool.stats().restarts >= pool.recovery.max_failures
    finally:
        pool.close()


@pytest.mark.parametrize("streams_per_call", [1, 2])
def test_a_killing_document_in_a_mixture_component_is_skipped_and_counted(ray_cluster,
                                                                          tmp_path,
                                                                          streams_per_call):
    """The same for a mixture: the traced document names its source, and the component skips
    it; the mixed rows equal those of the corpus with that document nulled, and the final
    state counts it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ingest.plan.deal import deal_units
    from ingest.stream.kinds import open_stream
    from tests.helpers import make_texts

    marker = "POISON-2c1e"
    for name, null in (("poisoned", False), ("nulled", True)):
        for src in ("a", "b"):
            (tmp_path / name / src).mkdir(parents=True)
            for i in range(2):
                texts = make_texts(40, seed=ord(src) * 10 + i)
                if src == "b" and i == 1:
                    texts[5] = None if null else texts[5] + " " + marker
                pq.write_table(pa.table({"text": pa.array(texts, pa.string())}),
                               tmp_path / name / src / f"{i}.parquet", row_group_size=10)

    def config(name):
        return Config(sources=(SourceConfig(paths=(str(tmp_path / name / "a"),), weight=2.0),
                               SourceConfig(paths=(str(tmp_path / name / "b"),))),
                      seq_len=32, global_batch_size=4, num_streams=2, unit_rows=10,
                      num_epochs=1, on_bad_document="skip",
                      runtime=RuntimeOptions(chunk_rows=3, prefetch=1,
                                             streams_per_call=streams_per_call))

    cfg, ref_cfg = config("poisoned"), config("nulled")
    plan, ref_plan = build_plan(cfg), build_plan(ref_cfg)
    for src in (0, 1):
        deal = dict(num_streams=2, seed=cfg.seed, epoch=0, shuffle=True, source=src)
        assert ([d.tolist() for d in deal_units(plan, **deal)]
                == [d.tolist() for d in deal_units(ref_plan, **deal)]), "precondition"
    pool = WorkerPool(cfg, plan, [0, 1], num_workers=1, get_timeout_s=60,
                      worker_cls=poisoned_worker(marker))
    crashed = 0
    try:
        pool.open({0: (None, 0), 1: (None, 0)})
        for s in (0, 1):
            rows, last = [], None
            while last is None or not last.exhausted:
                last = pool.next_chunk(s)
                rows.append(last.fields)
            want = open_stream(ref_cfg, ref_plan, s).produce(100_000).fields
            np.testing.assert_array_equal(np.concatenate(rows, axis=1), want,
                                          err_msg=f"stream {s}")
            crashed += sum(last.state_after["skipped"].get("worker_crash", {}).values())
        assert pool.stats().poisoned == 1
    finally:
        pool.close()
    assert crashed == 1


PHASES = ["spawn", "open", "first_chunk", "handoff", "resize", "close"]


@pytest.mark.parametrize("phase", PHASES)
def test_a_worker_killed_at_any_phase_of_the_pool_is_replaced_and_rows_do_not_change(
        ray_cluster, corpus, tmp_path, phase):
    """A worker SIGKILLed while the pool starts it, opens its streams, makes their first
    chunks, takes them over from the warm start, moves them in a resize, or closes: the run
    goes on (or ends) without an error, and every stream's rows are the unbroken run's."""
    from actors.warm_start import WarmStartSource

    cfg = _config(corpus, num_epochs=1, streams_per_call=2)
    plan = build_plan(cfg)
    streams = list(range(8))
    flag = str(tmp_path / "killed")
    worker_cls = {
        "spawn": dying_worker("__init__", flag),
        "open": dying_worker("open", flag),
        "first_chunk": dying_worker("produce", flag),
        "handoff": dying_worker("open", flag),
        # The third worker, started by the resize, dies as streams move onto it.
        "resize": dying_worker("open", flag, name="w2"),
        "close": None,
    }[phase]

    def make_pool(workers: int) -> WorkerPool:
        kw = {} if worker_cls is None else {"worker_cls": worker_cls}
        return WorkerPool(cfg, plan, streams, num_workers=workers, get_timeout_s=60, **kw)

    if phase == "handoff":
        source = WarmStartSource(cfg, plan, streams, await_ray=lambda: None,
                                 make_pool=make_pool, workers=2, step_rows=1,
                                 get_timeout_s=60)
    else:
        source = make_pool(2)
    before_chunk = None
    if phase == "resize":
        def before_chunk(i):
            if i == 8:
                source.request_resize(3)
            if i == 9:  # the resize applied: its worker starts, then takes streams
                refs = [source.location(w) for w in source.pending_workers]
                ray.wait(refs, num_returns=len(refs), timeout=60)
    try:
        source.open({s: (None, 0) for s in streams})
        if phase == "close":
            first = {s: source.next_chunk(s).fields for s in streams}
            assert faults.kill_random_worker(source, np.random.default_rng(0)) is not None
            source.close()  # with requests in flight to the dead worker
            want = _unbroken(cfg, plan, streams)
            for s in streams:
                np.testing.assert_array_equal(first[s], want[s][:, :first[s].shape[1]])
            return
        if phase == "handoff":
            # The host makes one chunk of each stream ahead, then waits: the pool takes over
            # the streams with all their rows still to make.
            assert source._opened.wait(60), "the pool never took over"
        got = read_streams(source, streams, before_chunk=before_chunk)
        stats = source.stats()
    finally:
        source.close()
    assert (tmp_path / "killed").exists(), f"no worker was killed at {phase}"
    assert _digest(got) == _digest(_unbroken(cfg, plan, streams))
    assert stats.restarts >= 1
