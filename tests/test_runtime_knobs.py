"""Runtime knobs left null (chunk_rows, streams_per_call, prefetch) resolve by a fixed rule from
seq_len, num_streams, workers and object_store_budget_mb where they are used
(``resolve_runtime``); explicit values win; and neither the batches nor a checkpoint's
fingerprint depend on them (local and Ray backends, real files, real tokenizer, 8 forced CPU
devices)."""

from __future__ import annotations

import json
import logging
import math
import queue
import threading

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import make_texts

from ingest import BatchDigest, Config, RuntimeOptions, SourceConfig
from ingest.config import load_config
from ingest.demo import demo_config
from ingest.errors import ConfigError
from ingest.plan import build_plan
from ingest.runtime import (
    AUTO_BUDGET_MB,
    CALL_TOKENS,
    CHUNK_TOKENS,
    ResolvedRuntime,
    resolve_runtime,
)
from jax_side import HostFeed, batch_sharding
from jax_side.local_source import LocalSource

DEADLINE_S = 120.0
OLD_DEFAULTS = {"chunk_rows": 16, "streams_per_call": 1, "prefetch": 2}


def cfg(**kw) -> Config:
    """A config with ``kw`` written flat, as YAML writes them (runtime options included)."""
    return Config.from_dict({"sources": [{"paths": ["corpus/x.parquet"]}], **kw})


def resolved(**kw) -> ResolvedRuntime:
    return resolve_runtime(cfg(**kw))


def rule(seq_len: int, num_streams: int, workers: int, budget_mb: float | None,
         prefetch: int = 2) -> tuple[int, int, int]:
    """The documented rule, written out independently of the config's code: about 1M tokens a
    call over a worker's share of the streams, at least 128k a chunk, within the budget."""
    share = max(1, num_streams // workers)
    row_bytes = (14 if seq_len < 65536 else 20) * seq_len  # tokens int32, layout uint16
    budget = (budget_mb if budget_mb is not None else AUTO_BUDGET_MB) * 2**20
    tokens = max(CHUNK_TOKENS, CALL_TOKENS // share)
    rows = min(tokens // seq_len, math.floor(budget / (num_streams * (prefetch + 1)
                                                       * row_bytes)))
    return max(1, rows), share, prefetch


@pytest.mark.parametrize(("seq_len", "num_streams", "workers", "budget_mb"), [
    (1024, 8, 2, None),      # the default config: 256 rows, 4 streams a call
    (1024, 16, 2, None),     # the demo on 2 CPUs: 128 rows, 8 streams a call
    (1024, 16, 8, None),     # 8 workers: 512 rows, 2 streams a call
    (1024, 16, 16, None),    # a stream a worker: the default budget bounds the chunk (910)
    (4096, 8, 4, None),      # longer rows: fewer of them (128)
    (64, 4, 3, None),        # short rows: 16384 rows; share rounded down, as the pool does (1)
    (1024, 4, 8, None),      # more workers than streams: one stream a call
    (200_000, 8, 2, None),   # rows longer than the token target: one row
    (4096, 256, 2, None),    # many streams: the default budget bounds the chunk (14 rows)
    (1024, 8, 2, 24),        # an explicit budget bounds it (8 x 3 x 24 KiB a row: 42 rows)
    (1024, 16, 16, 4096),    # a budget above what the target needs: 1024 rows, 1 a call
])
def test_auto_knobs_follow_the_rule(seq_len, num_streams, workers, budget_mb):
    c = resolved(seq_len=seq_len, num_streams=num_streams, global_batch_size=num_streams * 2,
                 workers=workers, object_store_budget_mb=budget_mb)
    want = rule(seq_len, num_streams, workers, budget_mb)
    assert (c.chunk_rows, c.streams_per_call, c.prefetch) == want
    assert all(c.is_auto(n) for n in OLD_DEFAULTS)
    # The resolved chunks fit the budget the rule used, with the requests it keeps in flight.
    bound = num_streams * (c.requests_in_flight(num_streams) + 1) * c.chunk_bytes
    assert c.chunk_rows == 1 or bound <= (budget_mb or AUTO_BUDGET_MB) * 2**20
    assert f"chunk_rows={want[0]} (auto: " in c.choices()
    # Made in this process (the local backend), a chunk keeps to the 128k-token floor.
    assert c.in_process_chunk_rows == min(c.chunk_rows, max(1, CHUNK_TOKENS // seq_len))


def test_a_call_makes_the_same_tokens_whatever_the_workers():
    """A worker's call (its streams' chunks together) is about 1M tokens from 1 to 8 streams a
    call, so its first call, which the first batch waits for, is as long on 16 workers as on
    2; within the default budget the chunks of 16 streams stay under 1 GiB."""
    for workers in (2, 4, 8, 16):
        c = resolved(num_streams=16, global_batch_size=32, workers=workers)
        call_tokens = c.chunk_rows * c.streams_per_call * c.seq_len
        assert 0.85 * CALL_TOKENS <= call_tokens <= CALL_TOKENS, (workers, c.choices())
        assert 16 * (c.prefetch + 1) * c.chunk_bytes <= AUTO_BUDGET_MB * 2**20
    # An explicit streams_per_call sizes the chunks by itself; an explicit chunk_rows wins.
    assert resolved(streams_per_call=1).chunk_rows == CALL_TOKENS // 1024
    assert resolved(streams_per_call=1, chunk_rows=64).chunk_rows == 64
    assert resolved(chunk_rows=300).in_process_chunk_rows == 300


def test_measured_setting_is_the_default():
    c = resolved()  # seq_len 1024, batch 32, 8 streams, 2 workers
    assert (c.chunk_rows, c.streams_per_call, c.prefetch) == (256, 4, 2)


def test_demo_uses_the_automatic_knobs_which_match_its_measured_settings():
    demo = resolve_runtime(demo_config(workers=2))
    assert all(demo.is_auto(n) for n in OLD_DEFAULTS)
    # The settings the demo was measured with: 128-row chunks, 2 in flight, and every stream
    # of a worker in one call (16 streams a call, capped at a worker's share, 8).
    assert (demo.chunk_rows, demo.prefetch, min(16, demo.num_streams // 2)) == (128, 2, 8)
    assert demo.streams_per_call == demo.num_streams // 2


def test_explicit_values_win_and_survive_replace():
    config = cfg(chunk_rows=16, streams_per_call=1, prefetch=3, seq_len=4096)
    c = resolve_runtime(config)
    assert (c.chunk_rows, c.streams_per_call, c.prefetch) == (16, 1, 3)
    assert not any(c.is_auto(n) for n in OLD_DEFAULTS)
    assert "chunk_rows=16 (explicit)" in c.choices()
    r = resolve_runtime(config.replace(seq_len=64, workers=4))
    assert (r.chunk_rows, r.streams_per_call, r.prefetch) == (16, 1, 3)
    # Auto values follow the fields they come from through replace; a value set there wins.
    a = resolve_runtime(cfg().replace(seq_len=2048, workers=8))
    assert (a.chunk_rows, a.streams_per_call) == (512, 1) and a.is_auto("chunk_rows")
    b = resolve_runtime(cfg().replace(chunk_rows=5))
    assert b.chunk_rows == 5 and not b.is_auto("chunk_rows") and b.is_auto("prefetch")
    # The options keep what was given: null stays null, resolved only where used.
    assert cfg().replace(chunk_rows=5).runtime == RuntimeOptions(chunk_rows=5)


def test_yaml_null_and_absent_are_auto_and_bad_values_are_named(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("sources: [{paths: [x.parquet]}]\nchunk_rows: null\nstreams_per_call: 2\n")
    c = resolve_runtime(load_config(str(p)))
    assert c.is_auto("chunk_rows") and c.chunk_rows == 512 and c.is_auto("prefetch")
    assert c.streams_per_call == 2 and not c.is_auto("streams_per_call")
    with pytest.raises(ConfigError, match=r"chunk_rows=0 must be a positive integer or null"):
        cfg(chunk_rows=0)
    with pytest.raises(ConfigError, match=r"tokenizer_backend='fast'.*\['auto', 'tiktoken'"):
        cfg(tokenizer_backend="fast")


def test_runtime_knobs_stay_out_of_the_fingerprint():
    auto = cfg()
    # The fingerprint this config has always had (checkpoints saved with it must restore).
    assert auto.fingerprint() == "80884b329813271d"
    for changes in (OLD_DEFAULTS, {"chunk_rows": 7, "streams_per_call": 3, "prefetch": 5},
                    {"tokenizer_backend": "tiktoken"}, {"workers": 5}):
        other = auto.replace(**changes)
        assert other.fingerprint() == auto.fingerprint()
        assert other.output_fields() == auto.output_fields()
    assert not {"chunk_rows", "streams_per_call", "prefetch", "tokenizer_backend"} & set(
        auto.output_fields())
    assert auto.replace(seq_len=512).fingerprint() != auto.fingerprint()  # it can fail


def test_runtime_choices_are_logged_once(caplog):
    c = cfg(seq_len=333)  # a line no other test logs
    with caplog.at_level(logging.INFO, logger="ingest.runtime"):
        resolve_runtime(c).log_choices()
        resolve_runtime(c.replace(seed=9)).log_choices()
    lines = [r.getMessage() for r in caplog.records if r.name == "ingest.runtime"]
    assert len(lines) == 1
    assert "chunk_rows=787 (auto: 1048576 tokens a call // streams_per_call 4 // seq_len 333)" \
        in lines[0]


# -- the batches do not depend on the knobs -------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("knobs_corpus")
    paths = []
    for i in range(4):
        path = d / f"part-{i}.parquet"
        pq.write_table(pa.table({"text": make_texts(60, seed=40 + i, max_words=60)}), str(path),
                       row_group_size=20)
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def sharding():
    assert len(jax.devices()) == 8
    return batch_sharding(jax.make_mesh((8,), ("data",)), "data")


def small(corpus, **kw) -> Config:
    fields = {"seq_len": 32, "global_batch_size": 16, "num_streams": 8, "unit_rows": 10,
              "seed": 3, "workers": 2, **kw}
    return Config.from_dict({"sources": [SourceConfig(paths=tuple(corpus))], **fields})


def drain(feed: HostFeed, max_steps: int | None = None) -> list[dict[str, np.ndarray]]:
    out: queue.Queue = queue.Queue()

    def consume():
        try:
            batches = []
            for b in feed:
                batches.append({k: np.asarray(v) for k, v in b.items()})
                if max_steps is not None and len(batches) >= max_steps:
                    break
            out.put(("ok", batches))
        except BaseException as e:  # noqa: BLE001 -- handed to the test thread
            out.put(("error", e))

    threading.Thread(target=consume, daemon=True).start()
    try:
        kind, value = out.get(timeout=DEADLINE_S)
    except queue.Empty:
        pytest.fail(f"the feed did not finish within {DEADLINE_S:.0f} s")
    if kind == "error":
        raise value
    return value


def digest(batches) -> str:
    d = BatchDigest()
    for b in batches:
        d.update(b)
    return d.hexdigest()


@pytest.fixture(scope="module")
def old_reference(corpus, sharding):
    c = small(corpus, **OLD_DEFAULTS)
    with HostFeed(c, sharding=sharding, backend="local") as feed:
        batches = drain(feed)
    assert len(batches) >= 5
    return batches


@pytest.mark.multidevice
def test_local_digest_auto_equals_the_old_explicit_settings(corpus, sharding, old_reference):
    auto = small(corpus)
    # 1M tokens a call over 4 streams, in rows of 32; made in this process, 128k tokens.
    rt = resolve_runtime(auto)
    assert (rt.chunk_rows, rt.in_process_chunk_rows, rt.streams_per_call) == (8192, 4096, 4)
    assert LocalSource(auto, build_plan(auto), [0])._rows == 4096
    with HostFeed(auto, sharding=sharding, backend="local") as feed:
        assert digest(drain(feed)) == digest(old_reference)


@pytest.mark.ray
@pytest.mark.multidevice
@pytest.mark.parametrize("workers", [2, 3])
def test_ray_digest_auto_equals_the_old_explicit_settings(ray_cluster, corpus, sharding,
                                                          old_reference, workers):
    auto = small(corpus, workers=workers)
    with HostFeed(auto, sharding=sharding, backend="ray", get_timeout_s=60) as feed:
        batches = drain(feed)
        pool = feed._intake.source
        chunks = pool.chunks_received
    assert digest(batches) == digest(old_reference)
    # One call makes the chunks of a worker's share of the streams (8 // workers).
    assert {len(pool.placement.group_of(s)) for s in range(8)} == {8 // workers}
    # The value the config reports (and logs) is the one the pool uses.
    assert pool.streams_per_call == resolve_runtime(auto).streams_per_call == 8 // workers
    assert chunks >= 8


@pytest.mark.multidevice
def test_checkpoint_of_old_settings_restores_under_auto(corpus, sharding, old_reference):
    old = small(corpus, **OLD_DEFAULTS)
    with HostFeed(old, sharding=sharding, backend="local") as feed:
        drain(feed, max_steps=2)
        state = json.loads(json.dumps(feed.get_state()))
    auto = small(corpus)
    assert state["config_fingerprint"] == auto.fingerprint()
    with HostFeed(auto, sharding=sharding, backend="local") as feed:
        feed.set_state(state)
        rest = drain(feed)
    assert digest(rest) == digest(old_reference[2:])
