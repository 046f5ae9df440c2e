"""Warm start: the host makes the first chunks while Ray starts, then the workers take over
where each stream is; the batches are those of the local backend, bit for bit."""

from __future__ import annotations

import os
import sys
import threading
import time

import jax
import numpy as np
import pytest

from actors import warm_start
from actors.warm_start import HOST_NICE, WarmStartSource
from ingest import BatchDigest, Config, SourceConfig
from ingest.plan.build import build_plan
from ingest.stream.local_source import LocalSource
from jax_side import HostFeed, batch_sharding
from tests.helpers import write_parquet_corpus

pytestmark = [pytest.mark.ray, pytest.mark.slow]

WAIT_S = 60.0


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("warm")
    write_parquet_corpus(d, n_files=3, docs_per_file=120, row_group_size=20, seed=11)
    return d


def _config(corpus, **kw) -> Config:
    fields = dict(sources=(SourceConfig(paths=(str(corpus),)),), seq_len=32,
                  global_batch_size=16, num_streams=8, num_epochs=2, unit_rows=10,
                  chunk_rows=4, prefetch=2, workers=2)
    fields.update(kw)
    return Config.from_dict(fields)


def _sharding():
    return batch_sharding(jax.make_mesh((len(jax.devices()),), ("data",)), "data")


def _digest(batch) -> str:
    d = BatchDigest()
    d.update({k: np.asarray(v) for k, v in batch.items()})
    return d.hexdigest()


class Gate:
    """``await_ray`` that returns once the test opens it: Ray is "up" at a step of its
    choosing. With ``error``, it raises that instead."""

    def __init__(self, error: BaseException | None = None):
        self.opened = threading.Event()
        self.error = error

    def __call__(self) -> None:
        assert self.opened.wait(WAIT_S), "the test never opened the gate"
        if self.error is not None:
            raise self.error


def _local_digests(cfg, state=None, steps=None) -> list[str]:
    with HostFeed(cfg, sharding=_sharding(), backend="local") as feed:
        if state is not None:
            feed.set_state(state)
        return [_digest(b) for _, b in zip(range(steps or 10**9), feed, strict=False)]


def _wait_for_handoff(feed: HostFeed) -> None:
    src = feed._intake.source
    assert isinstance(src, WarmStartSource)
    assert src._opened.wait(WAIT_S), "the workers never took over"


def test_the_workers_take_over_mid_run_and_the_batches_do_not_change(ray_cluster, corpus):
    cfg = _config(corpus)
    expected = _local_digests(cfg)
    assert len(expected) > 30
    gate = Gate()
    got = []
    with HostFeed(cfg, sharding=_sharding(), backend="ray", await_ray=gate) as feed:
        for i, batch in enumerate(feed):
            got.append(_digest(batch))
            if i == 9:
                src = feed._intake.source
                host_rows = src.host_rows
                gate.opened.set()
                _wait_for_handoff(feed)
        stats = feed.stats()
    assert got == expected
    # Ten steps of 2 rows on each of 8 streams came from this process before the gate opened
    # (more may have been made ahead, for the prefetched batches).
    assert host_rows >= 10 * 2 * 8
    assert stats["workers"] == 2 and sum(stats["rows_per_s_by_worker"].values()) > 0, stats
    assert stats["warm_start_rows"] >= host_rows


def test_a_restored_feed_starts_warm_at_its_saved_rows(ray_cluster, corpus):
    cfg = _config(corpus, num_epochs=None)
    with HostFeed(cfg, sharding=_sharding(), backend="local") as feed:
        for _, _ in zip(range(7), feed, strict=False):  # step 7: mid-chunk on every stream
            pass
        state = feed.get_state()
    assert any(e["taken"] for e in state["streams"].values())
    expected = _local_digests(cfg, state, steps=60)
    gate = Gate()
    got = []
    with HostFeed(cfg, sharding=_sharding(), backend="ray", await_ray=gate) as feed:
        feed.set_state(state)
        for i, batch in zip(range(60), feed, strict=False):
            got.append(_digest(batch))
            if i == 2:
                gate.opened.set()
                _wait_for_handoff(feed)
        stats = feed.stats()
    assert got == expected
    assert sum(stats["rows_per_s_by_worker"].values()) > 0, "the workers made no rows"


def test_a_pass_ended_before_ray_was_up_restarts_and_hands_off_in_the_next(ray_cluster,
                                                                           corpus):
    cfg = _config(corpus, num_epochs=1, reset_after_epoch=True)
    gate = Gate()
    with HostFeed(cfg, sharding=_sharding(), backend="ray", await_ray=gate) as feed:
        first = [_digest(b) for b in feed]  # every chunk made by this process
        assert feed._intake.source is None or not feed._intake.source._opened.is_set()
        second = []
        for i, batch in enumerate(feed):
            second.append(_digest(batch))
            if i == 4:
                gate.opened.set()
                _wait_for_handoff(feed)
        assert feed.counters.passes == 2
    assert len(first) > 10
    assert second == first


def test_ray_failing_to_start_fails_the_feed_with_its_error(ray_cluster, corpus):
    cfg = _config(corpus, num_epochs=None)
    gate = Gate(error=ConnectionError("no Ray cluster at 127.0.0.1:1"))
    with HostFeed(cfg, sharding=_sharding(), backend="ray", await_ray=gate) as feed:
        it = iter(feed)
        next(it)  # made by this process
        gate.opened.set()
        with pytest.raises(ConnectionError, match="no Ray cluster at 127.0.0.1:1"):
            for _, _ in zip(range(10_000), it, strict=False):
                pass


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread CPU priority")
def test_the_first_batch_is_made_at_normal_priority_and_the_rest_below_it(corpus, monkeypatch):
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if base >= HOST_NICE:
        pytest.skip(f"this process already runs at nice {base}")
    made: list[tuple[int, int]] = []  # (stream, the maker thread's nice while it made it)
    real = LocalSource.next_chunk

    def recording(self, s, rows=None):
        made.append((s, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        return real(self, s, rows)

    monkeypatch.setattr(LocalSource, "next_chunk", recording)
    cfg = _config(corpus, num_epochs=None)
    gate = Gate(error=ConnectionError("Ray never comes in this test"))
    try:
        with HostFeed(cfg, sharding=_sharding(), backend="ray", await_ray=gate) as feed:
            it = iter(feed)
            for _ in range(3):
                next(it)
            gate.opened.set()
    except ConnectionError:
        pass
    gate.opened.set()
    assert len(made) > cfg.num_streams, made
    seen: set[int] = set()
    for s, nice in made:
        assert nice == (base if len(seen) < cfg.num_streams else HOST_NICE), (s, seen, made)
        seen.add(s)


def test_the_hosts_chunks_double_from_one_steps_rows_to_the_cap_and_the_batches_do_not_change(
        corpus, monkeypatch):
    cfg = _config(corpus, num_epochs=1)
    expected = _local_digests(cfg)
    step_rows = cfg.global_batch_size // cfg.num_streams
    cap = 4 * step_rows + 1  # reached after three doublings, and not a power of two of them
    monkeypatch.setattr(warm_start, "CHUNK_TOKENS", cap * cfg.seq_len)
    asked: dict[int, list[int]] = {}  # stream -> rows asked of each host chunk, in order
    real = LocalSource.next_chunk

    def recording(self, s, rows=None):
        asked.setdefault(s, []).append(rows)
        return real(self, s, rows)

    monkeypatch.setattr(LocalSource, "next_chunk", recording)
    gate = Gate(error=ConnectionError("Ray never comes in this test"))
    with HostFeed(cfg, sharding=_sharding(), backend="ray", await_ray=gate) as feed:
        got = [_digest(b) for b in feed]  # every chunk made by this process
        gate.opened.set()
    assert got == expected
    assert sorted(asked) == list(range(cfg.num_streams))
    for s, rows in asked.items():
        want = [min(step_rows << k, cap) for k in range(len(rows))]
        assert rows == want, (s, rows)
        assert len(rows) > 4, (s, rows)  # the cap was reached and held


def test_closing_while_ray_starts_does_not_wait_for_it_and_no_pool_is_made_after(corpus):
    cfg = _config(corpus, num_epochs=None)
    gate = Gate()
    pools: list[int] = []
    plan = build_plan(cfg)
    src = WarmStartSource(cfg, plan, list(range(cfg.num_streams)), await_ray=gate,
                          make_pool=lambda n: pools.append(n), workers=2,
                          step_rows=cfg.global_batch_size // cfg.num_streams,
                          get_timeout_s=WAIT_S)
    src.open({s: (None, 0) for s in range(cfg.num_streams)})
    assert src.next_chunk(0).num_rows > 0  # made by this process
    closed = threading.Thread(target=src.close)
    closed.start()
    closed.join(WAIT_S / 2)
    assert not closed.is_alive(), "close waited for Ray to come up"
    assert src._thread.is_alive()  # still waiting for Ray
    gate.opened.set()
    src._thread.join(WAIT_S)
    assert not src._thread.is_alive()
    assert pools == [], "a pool was made after close"


def _record_makes(monkeypatch, block: tuple[int, int] | None = None
                  ) -> tuple[dict[int, list[int]], threading.Event, threading.Event]:
    """Records the rows of every host chunk, by stream. With ``block=(s, k)``, stream ``s``'s
    ``k``-th chunk waits for the returned ``release`` event, after setting ``reached``."""
    made: dict[int, list[int]] = {}
    reached, release = threading.Event(), threading.Event()
    real = LocalSource.next_chunk

    def recording(self, s, rows=None):
        made.setdefault(s, []).append(rows)
        if block == (s, len(made[s])):
            reached.set()
            assert release.wait(WAIT_S), "the test never released the chunk"
        return real(self, s, rows)

    monkeypatch.setattr(LocalSource, "next_chunk", recording)
    return made, reached, release


def _wait_until(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_the_host_keeps_one_chunk_of_every_stream_ready_ahead_of_the_caller(corpus,
                                                                           monkeypatch):
    cfg = _config(corpus, num_epochs=None)
    made, _, _ = _record_makes(monkeypatch)
    streams = list(range(cfg.num_streams))
    step_rows = cfg.global_batch_size // cfg.num_streams
    src = WarmStartSource(cfg, build_plan(cfg), streams, await_ray=Gate(),
                          make_pool=lambda n: None, workers=2, step_rows=step_rows,
                          get_timeout_s=WAIT_S)
    src.open({s: (None, 0) for s in streams})
    try:
        first = {s: src.next_chunk(s) for s in streams}  # the first batch's chunks
        # Nobody asks for more, and the next chunk of every stream is made all the same.
        _wait_until(lambda: all(len(made.get(s, ())) == 2 for s in streams),
                    f"the host did not make every stream's next chunk ahead: {made}")
        time.sleep(0.2)
        assert all(len(made[s]) == 2 for s in streams), f"more than one chunk ahead: {made}"
        assert all(first[s].num_rows == step_rows for s in streams)
        assert src.next_chunk(3).num_rows == 2 * step_rows  # the chunk made ahead
        _wait_until(lambda: len(made[3]) == 3, "the host did not make stream 3's third chunk")
        assert src.host_rows == len(streams) * 3 * step_rows + 4 * step_rows
    finally:
        src.close()


def test_a_chunk_being_made_at_the_handoff_is_dropped_and_the_batches_do_not_change(
        ray_cluster, corpus, monkeypatch):
    cfg = _config(corpus, num_epochs=1)
    expected = _local_digests(cfg)
    made, reached, release = _record_makes(monkeypatch, block=(0, 3))
    step_rows = cfg.global_batch_size // cfg.num_streams
    gate = Gate()
    got = []
    with HostFeed(cfg, sharding=_sharding(), backend="ray", await_ray=gate) as feed:
        for i, batch in enumerate(feed):
            got.append(_digest(batch))
            if i == 0:
                # The host made every stream's first two chunks (1 and 2 steps' rows), and
                # waits in stream 0's third, ahead of the caller: the workers take over now.
                assert reached.wait(WAIT_S), "the host never began stream 0's third chunk"
                src = feed._intake.source
                gate.opened.set()
                _wait_for_handoff(feed)
                release.set()
        stats = feed.stats()
    assert got == expected
    assert src.host_rows == cfg.num_streams * 3 * step_rows  # without the chunk dropped
    assert made[0] == [step_rows, 2 * step_rows, 4 * step_rows]
    assert stats["warm_start_rows"] == src.host_rows
    assert sum(stats["rows_per_s_by_worker"].values()) > 0, stats


def test_close_waits_for_the_hosts_chunk_being_made(corpus, monkeypatch):
    cfg = _config(corpus, num_epochs=None)
    _, reached, release = _record_makes(monkeypatch, block=(2, 2))
    streams = list(range(cfg.num_streams))
    src = WarmStartSource(cfg, build_plan(cfg), streams, await_ray=Gate(),
                          make_pool=lambda n: None, workers=2,
                          step_rows=cfg.global_batch_size // cfg.num_streams,
                          get_timeout_s=WAIT_S)
    src.open({s: (None, 0) for s in streams})
    for s in streams:
        src.next_chunk(s)
    assert reached.wait(WAIT_S), "the host never began stream 2's second chunk"
    closed = threading.Thread(target=src.close)
    closed.start()
    closed.join(0.5)
    # Native code must not run on while the process exits: close waits for the chunk.
    assert closed.is_alive(), "close returned while the host was making a chunk"
    release.set()
    closed.join(WAIT_S)
    assert not closed.is_alive() and not src._maker.is_alive()
