"""Runtime knobs left null (chunk_rows, streams_per_call, prefetch) resolve by a fixed rule from
seq_len, num_streams, workers and object_store_budget_mb where they are used
(``resolve_runtime``); explicit values win; and neither the batches nor a checkpoint's
fingerprint depend on them (local and Ray backends, real files, real tokenizer, 8 forced CPU
devices)."""

from __future__ import annotations

import dataclasses
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
from ingest.config import load_config, to_dict
from ingest.demo import demo_config
from ingest.errors import ConfigError
from ingest.plan.build import build_plan
from ingest.runtime import (
    AUTO_BUDGET_MB,
    CALL_TOKENS,
    CHUNK_TOKENS,
    TOKENIZER_BACKENDS,
    ResolvedRuntime,
    resolve_runtime,
)
from ingest.stream.local_source import LocalSource
from ingest.tokenize.bpe_backend import FASTEST_FIRST
from jax_side import HostFeed, batch_sharding

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


# -- the options: where they are written, what they change ------------------------------------

# to_dict of the config cfg(workers=3, pin_workers=False, batch_rampup={0: 0.5}) as it was
# saved before the runtime options had a class of their own: flat, with the automatic knobs
# written as their resolved values.
SAVED_FLAT = {
    "tokenizer": "gpt2", "bos": None, "seq_len": 1024, "global_batch_size": 32, "num_streams": 8,
    "packing": "concat", "packing_bins": 16, "long_documents": "split", "shift": "left",
    "predict_across_documents": False, "seed": 0, "shuffle": True, "num_epochs": 1,
    "drop_remainder": False, "reset_after_epoch": False, "batch_rampup": {"0": 0.5},
    "unit_rows": 256, "deal": "units", "on_bad_document": "error", "on_bad_file": "error",
    "tokenizer_backend": "auto", "workers": 3, "chunk_rows": 512, "streams_per_call": 2,
    "prefetch": 2, "object_store_budget_mb": None, "autoscale": False, "min_workers": 1,
    "max_workers": None, "autoscale_window_s": 2.0, "pin_workers": False,
    "prefault_object_store": True,
    "sources": [{"paths": ["corpus/x.parquet"], "text_column": "text", "tokens_column": None,
                 "weight": 1.0, "format": None, "kind": "files"}]}


def test_flat_runtime_keys_of_a_yaml_file_load_into_runtime(tmp_path):
    plain = "sources: [{paths: [x.parquet]}]\nseq_len: 512\n"
    p = tmp_path / "c.yaml"
    p.write_text(plain + "workers: 4\nchunk_rows: 16\npin_workers: false\n"
                         "tokenizer_backend: tiktoken\nreset_after_epoch: true\n")
    c = load_config(str(p))
    assert c.runtime == RuntimeOptions(workers=4, chunk_rows=16, pin_workers=False,
                                       tokenizer_backend="tiktoken", reset_after_epoch=True)
    assert c.seq_len == 512
    # A nested runtime mapping reads the same; and --set-style overrides go to runtime too.
    p.write_text(plain + "runtime:\n  workers: 4\n  chunk_rows: 16\n  pin_workers: false\n"
                         "  tokenizer_backend: tiktoken\n  reset_after_epoch: true\n")
    assert load_config(str(p)) == c
    assert load_config(str(p), workers=6).runtime.workers == 6
    (tmp_path / "plain.yaml").write_text(plain)
    assert load_config(str(tmp_path / "plain.yaml")).fingerprint() == c.fingerprint()


def test_runtime_keys_given_twice_or_unknown_in_runtime_are_named(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("sources: [{paths: [x.parquet]}]\nworkers: 2\n"
                 "runtime: {workers: 4, chunk_row: 8}\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(p))
    assert any(q.startswith("workers is given both flat (workers: 2) and in runtime "
                            "(workers: 4)") for q in e.value.problems), e.value.problems
    assert any(q.startswith("runtime: unknown field 'chunk_row'; did you mean 'chunk_rows'?")
               for q in e.value.problems), e.value.problems
    with pytest.raises(ConfigError, match=r"runtime=\[4\] must be a mapping of runtime options"):
        cfg(runtime=[4])


def test_a_flat_config_dict_saved_before_the_split_restores_as_it_was():
    c = Config.from_dict(SAVED_FLAT)
    assert c.fingerprint() == "7bd43c9174a3bbb5"  # what that config had when it was saved
    assert c.runtime.workers == 3 and c.runtime.pin_workers is False
    assert (c.runtime.chunk_rows, c.runtime.streams_per_call, c.runtime.prefetch) == (512, 2, 2)
    assert c.batch_rampup == {0: 0.5}
    # to_dict writes the same flat form, which reads back to the same config.
    assert to_dict(c) == SAVED_FLAT
    assert Config.from_dict(json.loads(json.dumps(to_dict(c)))) == c


# A value other than the default for every field; the runtime options' alternatives must
# leave the fingerprint alone, every other field's must change it.
OTHER_RUNTIME = {"workers": 5, "chunk_rows": 7, "streams_per_call": 3, "prefetch": 5,
                 "object_store_budget_mb": 512.0, "autoscale": True, "min_workers": 2,
                 "max_workers": 6, "autoscale_window_s": 0.5, "pin_workers": False,
                 "prefault_object_store": False, "tokenizer_backend": "tiktoken",
                 "reset_after_epoch": True}
OTHER_FIELDS = {"sources": (SourceConfig(paths=("corpus/y.parquet",)),), "tokenizer": "cl100k",
                "bos": 7, "seq_len": 512, "global_batch_size": 64, "num_streams": 4,
                "packing": "first_fit", "packing_bins": 8, "long_documents": "truncate",
                "shift": "right", "predict_across_documents": True, "seed": 1, "shuffle": False,
                "num_epochs": 2, "drop_remainder": True, "batch_rampup": {0: 0.5},
                "unit_rows": 128, "deal": "row_groups", "on_bad_document": "skip",
                "on_bad_file": "skip"}


def test_every_runtime_option_and_no_other_field_stays_out_of_the_fingerprint():
    assert set(OTHER_RUNTIME) == {f.name for f in dataclasses.fields(RuntimeOptions)}
    assert set(OTHER_FIELDS) | {"runtime"} == {f.name for f in dataclasses.fields(Config)}
    base = cfg()
    for name, value in OTHER_RUNTIME.items():
        other = base.replace(**{name: value})
        assert getattr(other.runtime, name) == value
        assert other.fingerprint() == base.fingerprint(), name
    every = base.replace(runtime=RuntimeOptions(**OTHER_RUNTIME))
    assert every.fingerprint() == base.fingerprint() and every.output_fields() == base.output_fields()
    for name, value in OTHER_FIELDS.items():
        assert base.replace(**{name: value}).fingerprint() != base.fingerprint(), name


@pytest.mark.parametrize(("options", "problem"), [
    ({"workers": 0}, "workers=0 must be a positive integer"),
    ({"prefetch": -1}, "prefetch=-1 must be a positive integer or null"),
    ({"streams_per_call": 1.5}, "streams_per_call=1.5 must be a positive integer or null"),
    ({"autoscale": "yes"}, "autoscale='yes' must be true or false"),
    ({"autoscale_window_s": 0}, "autoscale_window_s=0 must be a number of seconds > 0"),
    ({"object_store_budget_mb": 0}, "object_store_budget_mb=0 must be a number > 0 or null"),
    ({"min_workers": 4, "max_workers": 2}, "max_workers=2 is below min_workers=4"),
    ({"tokenizer_backend": "fast"}, "tokenizer_backend='fast' must be one of ['auto', "
                                    "'tiktoken', 'toktok', 'tuetoken', 'rs_bpe', 'bpe_openai', "
                                    "'riptoken']"),
    ({"reset_after_epoch": True, "num_epochs": 2},
     "reset_after_epoch=true restarts the feed after each pass, which needs num_epochs=1 "
     "(got num_epochs=2); set num_epochs: 1 or reset_after_epoch: false"),
])
def test_an_invalid_runtime_option_is_named_as_yaml_writes_it(options, problem):
    with pytest.raises(ConfigError) as e:
        cfg(**options)
    assert e.value.problems == [problem]
    with pytest.raises(ConfigError) as e:
        cfg().replace(**options)
    assert e.value.problems == [problem]
    # With the config's own problems, every one is reported at once.
    with pytest.raises(ConfigError) as e:
        cfg(seq_len=0, **options)
    assert set(e.value.problems) == {"seq_len=0 must be a positive integer", problem}


def test_resolution_reports_the_reason_for_each_automatic_value():
    rt = resolved()
    assert rt.reasons == {
        "prefetch": "auto: two requests in flight per stream",
        "chunk_rows": "auto: 1048576 tokens a call // streams_per_call 4 // seq_len 1024",
        "streams_per_call": "auto: a worker's share of the streams, num_streams 8 // workers 2; "
                            "the pool takes the share of the streams its host owns"}
    assert rt.choices() == ", ".join(f"{n}={getattr(rt, n)} ({rt.reasons[n]})"
                                     for n in ("chunk_rows", "streams_per_call", "prefetch"))
    # A budget that bounds the chunk is named as the reason.
    small_budget = resolved(object_store_budget_mb=24)
    assert small_budget.reasons["chunk_rows"] == (
        "auto: 24 MB budget / (num_streams 8 x (prefetch 2 + 1) x 14336 bytes a row)")
    explicit = resolved(chunk_rows=16, streams_per_call=1, prefetch=3)
    assert explicit.reasons == {}
    assert explicit.choices() == ("chunk_rows=16 (explicit), streams_per_call=1 (explicit), "
                                  "prefetch=3 (explicit)")


def test_config_validation_does_not_import_the_tokenizer_backends():
    from test_layering import module_graph

    graph = module_graph(["ingest"])
    reached, todo = set(), ["ingest.config"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += graph.get(module, {})
    assert {"ingest.config_checks", "ingest.runtime"} <= reached
    assert not {m for m in reached if m.startswith(("ingest.bpe_", "ingest.tokenize.tokenizer"))}, reached
    # The names the options accept are the backends' own (checked here, not at import).
    assert TOKENIZER_BACKENDS == ("auto", "tiktoken", *FASTEST_FIRST)


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
