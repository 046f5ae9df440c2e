"""The streaming feed, end to end, on one host: HostFeed over real files, real tokenizers, real
JAX devices (8 forced CPU devices) and the session's real Ray cluster.

One small corpus (four Parquet files of short English-like documents) is fed to the end of its
single epoch. The reference run uses the ``local`` backend on a 1-D mesh of all 8 devices; every
other run (Ray with 1, 2 or 3 workers, 2-D meshes, other shardings, resumes) must reproduce it
bit for bit. Every drain of a feed runs under a deadline, so a hang fails the test instead of
blocking the session.
"""

from __future__ import annotations

import json
import queue
import random
import re
import threading
import time
from typing import Any

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import drain as drain_stream
from jax.sharding import NamedSharding, PartitionSpec

from ingest import FIELDS, BatchDigest, Config, SourceConfig, Stream, build_plan
from ingest.stream.chunk_format import RowPieces, batch_groups, fields_of
from jax_side import HostFeed, batch_sharding
from jax_side.chunk_intake import ChunkIntake
from jax_side.feed_stats import steady_window_start

DEADLINE_S = 120.0  # generous for 2 CPUs; a healthy drain of this corpus takes a few seconds

SEQ_LEN = 32
GLOBAL_BATCH = 16
NUM_STREAMS = 8
K = GLOBAL_BATCH // NUM_STREAMS  # rows per stream per step

WORDS = ("the quick brown fox jumps over a lazy dog near old stone bridge under grey sky while "
         "people walk to market with bread apples cheese fresh fish and children laugh").split()


# -- fakes: small real corpora ------------------------------------------------------------


def make_texts(n: int, seed: int) -> list[str]:
    """``n`` distinct short documents (2-30 words), each tagged so no two are alike."""
    rng = random.Random(seed)
    return [f"Doc{seed}x{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30)))
            + "." for i in range(n)]


def write_corpus(directory, *, n_files: int = 4, docs_per_file: int = 60,
                 row_group_size: int = 20, seed: int = 0) -> list[str]:
    """Writes ``part-NNNNN.parquet`` files with a ``text`` column; returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n_files):
        path = directory / f"part-{i:05d}.parquet"
        texts = make_texts(docs_per_file, seed * 100 + i)
        pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), str(path),
                       row_group_size=row_group_size)
        paths.append(str(path))
    return paths


def make_config(paths, **overrides: Any) -> Config:
    fields: dict[str, Any] = dict(seq_len=SEQ_LEN, global_batch_size=GLOBAL_BATCH,
                                  num_streams=NUM_STREAMS, unit_rows=10, num_epochs=1, seed=3,
                                  # 3 rows per chunk: chunks straddle steps (k = 2).
                                  chunk_rows=3, prefetch=2, workers=2)
    fields.update(overrides)
    return Config.from_dict({"sources": [SourceConfig(paths=tuple(str(p) for p in paths))],
                             **fields})


# -- driving a feed under a deadline ------------------------------------------------------


def drain_arrays(feed: HostFeed, *, max_steps: int | None = None, after_each=None,
                 deadline_s: float = DEADLINE_S) -> list[dict[str, jax.Array]]:
    """Every batch of ``feed`` (or the first ``max_steps``), as the ``jax.Array``s it returned.

    Iterates on a helper thread so that a hang fails with a message; an exception raised by the
    feed is re-raised here. ``after_each(feed)`` runs after each batch, on that thread.
    """
    out: queue.Queue = queue.Queue()

    def consume():
        batches = []
        try:
            for batch in feed:
                batches.append(batch)
                if after_each is not None:
                    after_each(feed)
                if max_steps is not None and len(batches) >= max_steps:
                    break
            out.put(("ok", batches))
        except BaseException as e:  # noqa: BLE001 -- handed to the test thread
            out.put(("error", e))

    threading.Thread(target=consume, daemon=True).start()
    try:
        kind, value = out.get(timeout=deadline_s)
    except queue.Empty:
        pytest.fail(f"the feed did not finish within {deadline_s:.0f} s (a hang); "
                    f"stats so far: {feed.stats()}")
    if kind == "error":
        raise value
    return value


def drain(feed: HostFeed, **kwargs: Any) -> list[dict[str, np.ndarray]]:
    """Like `drain_arrays`, as host numpy arrays."""
    return [{name: np.asarray(a) for name, a in batch.items()}
            for batch in drain_arrays(feed, **kwargs)]


def digest_of(batches: list[dict[str, np.ndarray]]) -> str:
    d = BatchDigest()
    for b in batches:
        d.update(b)
    return d.hexdigest()


def stream_rows(config: Config, plan, stream_id: int) -> np.ndarray:
    """Every row of one stream run directly (``[6, n, seq_len]``), asking k rows at a time."""
    return drain_stream(Stream(config, plan, stream_id), n_rows=config.rows_per_stream)


def all_zero_rows(batch: dict[str, np.ndarray]) -> np.ndarray:
    """Bool ``[B]``: rows that are zero in every field."""
    return np.all([~np.any(batch[f], axis=1) for f in FIELDS], axis=0)


# -- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, (f"these tests need 8 CPU devices (XLA_FLAGS="
                            f"--xla_force_host_platform_device_count=8), got {len(devs)}")
    return devs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("feed_corpus"))


@pytest.fixture(scope="module")
def config(corpus):
    return make_config(corpus)


@pytest.fixture(scope="module")
def plan(config):
    return build_plan(config)


@pytest.fixture(scope="module")
def sharding_1d(devices):
    return batch_sharding(jax.make_mesh((8,), ("data",)), "data")


@pytest.fixture(scope="module")
def reference(config, plan, sharding_1d):
    """The local backend on the 1-D mesh, to the end of the data: batches, the state after each
    step (``states[i]`` after i steps) and the final stats."""
    feed = HostFeed(config, sharding=sharding_1d, backend="local", plan=plan)
    states = [json.loads(json.dumps(feed.get_state()))]
    with feed:
        batches = drain(feed, after_each=lambda f: states.append(
            json.loads(json.dumps(f.get_state()))))
        stats = feed.stats()
    assert len(batches) >= 5, "the corpus should give several steps"
    return {"batches": batches, "states": states, "stats": stats,
            "digest": digest_of(batches)}


# -- determinism across workers, backends and meshes --------------------------------------


@pytest.mark.ray
@pytest.mark.multidevice
@pytest.mark.parametrize(("workers", "streams_per_call"), [(1, 1), (2, 1), (3, 1), (1, 4),
                                                            (2, 2), (3, 3)])
def test_ray_feed_digest_matches_local_for_any_worker_count(ray_cluster, config, plan,
                                                            sharding_1d, reference, workers,
                                                            streams_per_call):
    cfg = config.replace(streams_per_call=streams_per_call)
    with HostFeed(cfg, sharding=sharding_1d, backend="ray", workers=workers,
                  plan=plan, get_timeout_s=60) as feed:
        batches = drain(feed)
        stats = feed.stats()
        pool = feed._intake.source
        chunks, requests = pool.chunks_received, pool.stats().requests
    # Grouped: the streams of a group run out of chunks at the same step, so (start and end
    # aside) one call serves them all. Groups are at most a worker's share of the streams.
    group = min(streams_per_call, NUM_STREAMS // workers)
    assert requests <= chunks / group + NUM_STREAMS, (requests, chunks)
    if streams_per_call == 1:
        assert requests >= chunks
    assert len(batches) == len(reference["batches"])
    assert digest_of(batches) == reference["digest"]
    assert stats["backend"] == "ray"
    assert stats["workers"] == min(workers, NUM_STREAMS)
    assert stats["padding_rows"] == reference["stats"]["padding_rows"]
    assert stats["tokens"] == reference["stats"]["tokens"]


@pytest.mark.ray
@pytest.mark.multidevice
def test_row_group_deal_gives_the_same_batches_on_ray_as_local(ray_cluster, config,
                                                               sharding_1d, reference):
    """deal: row_groups (here runs of 2 of a group's 4 units) reproduces the local backend's
    batches on Ray, with the default deal's tokens in another order."""
    cfg = config.replace(deal="row_groups", unit_rows=5)
    plan = build_plan(cfg)
    with HostFeed(cfg, sharding=sharding_1d, backend="local", plan=plan) as feed:
        local = drain(feed)
        tokens = feed.stats()["tokens"]
    with HostFeed(cfg, sharding=sharding_1d, backend="ray", workers=2, plan=plan,
                  get_timeout_s=60) as feed:
        assert digest_of(drain(feed)) == digest_of(local)
    with HostFeed(cfg.replace(deal="units"), sharding=sharding_1d, backend="local",
                  plan=plan) as feed:
        assert digest_of(drain(feed)) != digest_of(local)
    assert tokens == reference["stats"]["tokens"]


@pytest.mark.multidevice
def test_batches_have_six_int32_fields_with_requested_sharding(sharding_1d, reference, config,
                                                              plan):
    feed = HostFeed(config, sharding=sharding_1d, backend="local", plan=plan)
    with feed:
        for batch in drain_arrays(feed, max_steps=2):
            assert sorted(batch) == sorted(FIELDS)
            assert len(FIELDS) == 6
            for name, arr in batch.items():
                assert isinstance(arr, jax.Array), name
                assert arr.shape == (GLOBAL_BATCH, SEQ_LEN), name
                assert arr.dtype == np.int32, name
                assert arr.sharding == sharding_1d, name


@pytest.mark.parametrize("n_devices", [1, 8])
def test_delivered_batches_keep_their_values_while_the_feed_goes_on(devices, config, plan,
                                                                   reference, n_devices):
    # On one CPU device the arrays share the feed's host buffer (no copy): the feed must never
    # write a buffer again once its batch is delivered.
    sharding = batch_sharding(jax.make_mesh((n_devices,), ("data",),
                                            devices=jax.devices()[:n_devices]), "data")
    held, copies = [], []

    def consume():
        for batch in feed:
            held.append(batch)
            copies.append({name: np.array(a, copy=True) for name, a in batch.items()})

    with HostFeed(config, sharding=sharding, backend="local", plan=plan) as feed:
        worker = threading.Thread(target=consume, daemon=True)
        worker.start()
        worker.join(timeout=DEADLINE_S)
        assert not worker.is_alive(), f"the feed did not finish within {DEADLINE_S} s"
    assert len(held) == len(reference["batches"]) >= 5
    for got, at_delivery in zip(held, copies, strict=True):
        for name in FIELDS:
            np.testing.assert_array_equal(np.asarray(got[name]), at_delivery[name],
                                          err_msg=name)


@pytest.mark.multidevice
@pytest.mark.parametrize("spec", [
    PartitionSpec("data"),                      # rows over data, replicated over model
    PartitionSpec(("data", "model")),           # rows over both axes
    PartitionSpec(("model", "data")),           # rows over both axes, other device order
    PartitionSpec("data", "model"),             # rows over data, tokens over model
    PartitionSpec(("data", "model"), None),
], ids=str)
def test_two_dimensional_mesh_gives_the_same_batches(devices, config, plan, reference, spec):
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    sharding = NamedSharding(mesh, spec)
    feed = HostFeed(config, sharding=sharding, backend="local", plan=plan)
    assert feed.streams == tuple(range(NUM_STREAMS))
    with feed:
        arrays = drain_arrays(feed, max_steps=10_000)
    assert len(arrays) == len(reference["batches"])
    for step, (batch, want) in enumerate(zip(arrays, reference["batches"], strict=True)):
        assert sorted(batch) == sorted(FIELDS)
        for name, arr in batch.items():
            assert arr.shape == (GLOBAL_BATCH, SEQ_LEN), name
            assert arr.dtype == np.int32, name
            assert arr.sharding == sharding, (name, arr.sharding)
            # Every device holds exactly the slice the sharding assigns to it.
            for shard in arr.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), want[name][shard.index],
                                              err_msg=f"step {step}, {name}, {shard.device}")
    host = [{n: np.asarray(a) for n, a in b.items()} for b in arrays]
    assert digest_of(host) == reference["digest"]


# -- row placement, padding and counts ----------------------------------------------------


def test_rows_of_stream_s_fill_block_s_of_every_step(config, plan, reference):
    batches = reference["batches"]
    per_stream = [stream_rows(config, plan, s) for s in range(NUM_STREAMS)]
    # The feed runs until the longest stream ends; no step is all padding.
    assert len(batches) == max(-(-r.shape[1] // K) for r in per_stream)
    for step, batch in enumerate(batches):
        assert not all_zero_rows(batch).all(), f"step {step} is entirely padding"
        for s, rows in enumerate(per_stream):
            want = np.zeros((len(FIELDS), K, SEQ_LEN), np.int32)
            have = rows[:, step * K:(step + 1) * K]
            want[:, :have.shape[1]] = have
            for i, name in enumerate(FIELDS):
                np.testing.assert_array_equal(
                    batch[name][s * K:(s + 1) * K], want[i],
                    err_msg=f"step {step}, stream {s}, field {name}")


def test_finite_data_stops_and_pads_ended_streams_with_counted_zero_rows(config, plan,
                                                                         sharding_1d):
    feed = HostFeed(config, sharding=sharding_1d, backend="local", plan=plan)
    with feed:
        batches = drain(feed)
        # The iterator stays finished.
        with pytest.raises(StopIteration):
            next(feed)
        stats = feed.stats()
    padding = sum(int(all_zero_rows(b).sum()) for b in batches)
    assert padding > 0, "streams of this corpus end at different steps: expected padding rows"
    assert stats["padding_rows"] == padding
    for step, b in enumerate(batches):
        zero = all_zero_rows(b)
        # A row is padding exactly where its segmentation is 0 everywhere.
        np.testing.assert_array_equal(zero, ~b["inputs_segmentation"].any(axis=1),
                                      err_msg=f"step {step}")
        np.testing.assert_array_equal(zero, ~b["targets_segmentation"].any(axis=1)
                                      & ~b["inputs_segmentation"].any(axis=1),
                                      err_msg=f"step {step}")
    tokens = sum(int(np.count_nonzero(b["inputs_segmentation"])) for b in batches)
    assert stats["tokens"] == tokens > 0
    assert stats["padding_tokens"] == len(batches) * GLOBAL_BATCH * SEQ_LEN - tokens
    assert stats["steps"] == len(batches)
    assert stats["documents"] == 4 * 60


def test_the_end_of_a_chunk_taken_inside_a_step_is_copied_out_before_the_next_chunk(config,
                                                                                    plan):
    # The object-store bound counts, per stream, the requests in flight and one chunk in hand:
    # rows from the end of a chunk that wait for the step's copy must not keep that chunk (and
    # its place in the store) alive beside the next one, whose request went out when it came.
    intake = ChunkIntake(config, plan, (0,), backend="local", workers=1, get_timeout_s=30)
    intake.open()
    try:
        assert intake.take(0, RowPieces(SEQ_LEN), K) == K
        used_up = intake.cursors[0].chunk
        assert used_up.num_rows == 3, "the test needs a chunk that ends inside the next step"
        pieces = RowPieces(SEQ_LEN)
        assert intake.take(0, pieces, K) == K  # its last row, then the next chunk's first
        assert intake.cursors[0].chunk is not used_up
        held = [a.shape for a in (*pieces._tokens, *pieces._positions, *pieces._segments)
                if np.shares_memory(a, used_up.tokens) or np.shares_memory(a, used_up.layout)]
        assert not held, f"the step's pieces still view the used-up chunk: {held}"
        out = np.empty((len(FIELDS), K, SEQ_LEN), np.int32)
        pieces.copy_into(batch_groups(out))
        np.testing.assert_array_equal(out[:, :1], fields_of(used_up.tokens, used_up.layout)[:, 2:])
    finally:
        intake.close()


def test_once_a_stream_ends_its_later_blocks_stay_zero(reference):
    ended: set[int] = set()
    for step, b in enumerate(reference["batches"]):
        zero = all_zero_rows(b).reshape(NUM_STREAMS, K)
        for s in ended:
            assert zero[s].all(), f"stream {s} ended before step {step} but has rows in it"
        # Within a block, padding only follows real rows.
        for s in range(NUM_STREAMS):
            first_zero = np.flatnonzero(zero[s])
            if first_zero.size:
                assert zero[s, first_zero[0]:].all(), f"step {step}, stream {s}"
                ended.add(s)
    assert ended, "no stream ended before the last step"


def test_consumer_wait_stats_are_present_and_non_negative(reference):
    stats = reference["stats"]
    for key in ("wait_s", "wait_max_s", "stall_fraction", "tokens_per_s"):
        assert key in stats, key
        assert stats[key] >= 0, (key, stats[key])
    assert stats["wait_max_s"] <= stats["wait_s"] + 1e-9
    assert stats["stall_fraction"] <= 1.0
    assert stats["tokens_per_s"] > 0
    assert stats["steps"] == len(reference["batches"])
    assert stats["backend"] == "local"


@pytest.mark.parametrize(("steps", "start"), [(0, None), (3, None), (4, 2), (7, 2), (8, 4),
                                             (478, 128), (512, 256), (1442, 512)])
def test_steady_window_starts_at_the_largest_power_of_two_within_half_the_steps(steps, start):
    assert steady_window_start(steps) == start


def test_steady_rate_and_stall_cover_only_the_later_steps(config, plan, sharding_1d):
    """A consumer slow before the steady window and fast inside it: the steady rate leaves the
    slow steps out, and the steady stall counts only the waits inside the window."""
    feed = HostFeed(config, sharding=sharding_1d, backend="local", plan=plan)
    with feed:
        n = len(drain(feed, max_steps=1000))
    m = steady_window_start(n)
    assert m is not None and m < n, f"the corpus gives {n} steps; the test needs at least 4"

    def slow_first_steps(f):
        if f.counters.steps < m:
            time.sleep(0.2)

    feed = HostFeed(config, sharding=sharding_1d, backend="local", plan=plan)
    with feed:
        drain(feed, after_each=slow_first_steps)
        stats = feed.stats()
    assert stats["steady_from_step"] == m
    # The window's steps came without the sleeps: far faster than the run's rate over all.
    assert stats["steady_tokens_per_s"] > 2 * stats["tokens_per_s"], stats
    assert 0 <= stats["steady_stall_fraction"] <= 1


# -- state ---------------------------------------------------------------------------------


def test_get_state_after_each_step_names_that_step_and_is_json(reference):
    states = reference["states"]
    assert [s["step"] for s in states] == list(range(len(reference["batches"]) + 1))
    for s in states:
        assert set(s["streams"]) == {str(i) for i in range(NUM_STREAMS)}
    # Prefetching ahead never leaks into the state: consecutive states differ.
    for a, b in zip(states, states[1:], strict=False):
        assert a["streams"] != b["streams"]


def test_state_after_each_step_restores_the_rest_exactly(config, plan, sharding_1d, reference):
    batches = reference["batches"]
    for step, state in enumerate(reference["states"]):
        feed = HostFeed(config, sharding=sharding_1d, backend="local", plan=plan)
        feed.set_state(json.loads(json.dumps(state)))
        assert feed.get_state() == state, f"restored state at step {step} reads back differently"
        with feed:
            rest = drain(feed)
        assert len(rest) == len(batches) - step, f"restored at step {step}"
        assert digest_of(rest) == digest_of(batches[step:]), f"restored at step {step}"


def test_stats_count_documents_exactly_at_every_step_and_after_restore(config, plan,
                                                                      sharding_1d, reference):
    # States are saved at chunk ends (3 rows here; a step takes 2 of each stream), yet the
    # documents reported after each step are those of exactly the rows delivered.
    by_row = []
    for s in range(NUM_STREAMS):
        chunk = Stream(config, plan, s).produce(10_000)
        assert chunk.exhausted
        by_row.append(chunk.documents)

    def expected(step: int) -> int:
        return sum(int(d[min(step * K, len(d)) - 1]) for d in by_row) if step else 0

    seen = []
    with HostFeed(config, sharding=sharding_1d, backend="local", plan=plan) as feed:
        drain(feed, after_each=lambda f: seen.append(f.stats()["documents"]))
    assert seen == [expected(step) for step in range(1, len(seen) + 1)]
    assert seen[-1] == 4 * 60 and len(set(seen)) == len(seen)
    for step in (1, 2, 3):
        restored = HostFeed(config, sharding=sharding_1d, backend="local", plan=plan)
        restored.set_state(json.loads(json.dumps(reference["states"][step])))
        assert restored.stats()["documents"] == expected(step), f"restored at step {step}"


def test_get_state_ignores_batches_prefetched_ahead(config, plan, sharding_1d, reference):
    # A slow consumer: after each batch the background thread has time to fill its queue
    # (device_prefetch=2) and to start the next step, yet the state must be exactly the one
    # after the batches received. A fixed pause, not a wait for a condition: with correct code
    # the test passes however far the producer got.
    states = []

    def slow_consumer(feed):
        time.sleep(0.1)
        states.append(json.loads(json.dumps(feed.get_state())))

    with HostFeed(config, sharding=sharding_1d, backend="local", plan=plan,
                  device_prefetch=2) as feed:
        batches = drain(feed, after_each=slow_consumer)
    assert digest_of(batches) == reference["digest"]
    assert [s["step"] for s in states] == list(range(1, len(batches) + 1))
    assert states == reference["states"][1:]
    step = 2
    with HostFeed(config, sharding=sharding_1d, backend="local", plan=plan) as feed:
        feed.set_state(states[step - 1])
        rest = drain(feed)
    assert digest_of(rest) == digest_of(batches[step:])


# Chunks of 12 rows: a round of 4 steps (8 rows of each stream), then 2 single steps, then
# the next chunk; with the ramp-up, rounds only where 4 steps have one batch size.
@pytest.mark.parametrize("rampup", [None, {7: 0.5}])
def test_steps_assembled_in_rounds_are_the_single_steps_bit_for_bit_with_their_states(
        corpus, sharding_1d, monkeypatch, rampup):
    import jax_side.feed as feed_module
    from jax_side import batch_assembly

    config = make_config(corpus, chunk_rows=12, batch_rampup=rampup)
    plan = build_plan(config)
    rounds = []

    def counted_fill_round(*args, **kwargs):
        batches = batch_assembly.fill_round(*args, **kwargs)
        rounds.append(batches is not None)
        return batches

    monkeypatch.setattr(feed_module, "fill_round", counted_fill_round)

    def run(device_prefetch: int, state=None) -> tuple[list, list]:
        feed = HostFeed(config, sharding=sharding_1d, backend="local", plan=plan,
                        device_prefetch=device_prefetch)
        if state is not None:
            feed.set_state(json.loads(json.dumps(state)))
        states = [json.loads(json.dumps(feed.get_state()))]
        with feed:
            batches = drain(feed, after_each=lambda f: states.append(
                json.loads(json.dumps(f.get_state()))))
        return batches, states

    single, single_states = run(device_prefetch=1)  # one step at a time
    assert not any(rounds)
    batches, states = run(device_prefetch=4)
    assert sum(rounds) >= 2 and not all(rounds), rounds  # rounds and single steps both ran
    assert len(batches) == len(single) >= 12
    for step, (ours, theirs) in enumerate(zip(batches, single, strict=True)):
        for name in FIELDS:
            np.testing.assert_array_equal(ours[name], theirs[name], err_msg=f"{name}, {step}")
    assert states == single_states
    for step in (1, 3, 5):  # inside a round, at its end, after the single steps
        rest, _ = run(device_prefetch=4, state=states[step])
        assert digest_of(rest) == digest_of(single[step:]), f"restored at step {step}"


@pytest.mark.ray
@pytest.mark.multidevice
def test_state_saved_on_local_backend_resumes_on_ray_workers(ray_cluster, config, plan,
                                                             reference):
    # A mid-run state where streams stopped inside a chunk (chunk_rows=3, k=2), so the workers
    # must reopen at the chunk's base state and skip the rows already taken.
    step = next(i for i in range(len(reference["batches"]) // 2, 0, -1)
                if any(st["taken"] for st in reference["states"][i]["streams"].values()))
    state = reference["states"][step]
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    sharding = NamedSharding(mesh, PartitionSpec("data", "model"))
    feed = HostFeed(config, sharding=sharding, backend="ray", workers=3, plan=plan,
                    get_timeout_s=60)
    feed.set_state(state)
    with feed:
        rest = drain(feed)
    assert digest_of(rest) == digest_of(reference["batches"][step:])


# -- errors ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus_with_null(tmp_path_factory):
    """Three good files and one whose row 7 (in row group 0) holds a null text."""
    d = tmp_path_factory.mktemp("null_corpus")
    paths = write_corpus(d, n_files=3, seed=5)
    texts: list[str | None] = make_texts(60, 999)
    texts[7] = None
    bad = d / "part-bad.parquet"
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), str(bad),
                   row_group_size=20)
    return [*paths, str(bad)], str(bad)


@pytest.mark.parametrize("backend", [
    pytest.param("local", marks=pytest.mark.multidevice),
    pytest.param("ray", marks=[pytest.mark.ray, pytest.mark.multidevice]),
])
def test_bad_document_error_reaches_the_host_naming_file_and_row(request, corpus_with_null,
                                                                  sharding_1d, backend):
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    paths, bad_path = corpus_with_null
    config = make_config(paths, on_bad_document="error")
    feed = HostFeed(config, sharding=sharding_1d, backend=backend, workers=2, get_timeout_s=60)
    with feed:
        with pytest.raises(Exception) as info:  # noqa: B017 -- type checked below
            drain(feed)
        # The feed is finished after the error, not wedged.
        with pytest.raises(StopIteration):
            next(feed)
    message = str(info.value)
    assert bad_path in message, message
    assert re.search(r"\brow 7\b", message), message
    assert "null" in message, message
    if backend == "ray":
        # Raised on the host, carrying the worker and the stream.
        assert isinstance(info.value, RuntimeError), type(info.value)
        assert 0 <= info.value.stream_id < NUM_STREAMS
        assert f"stream {info.value.stream_id}" in message, message
        assert info.value.worker in message, message
    else:
        assert isinstance(info.value, ValueError), type(info.value)


def test_bad_document_error_row_is_the_row_within_the_file(tmp_path, sharding_1d):
    # BadInputError documents ``row`` as "the row within the file".
    texts: list[str | None] = make_texts(40, 11)
    texts[25] = None  # row 5 of row group 1
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), str(path),
                   row_group_size=20)
    config = make_config([path], num_streams=1, global_batch_size=8, unit_rows=10)
    with HostFeed(config, sharding=sharding_1d, backend="local") as feed:
        with pytest.raises(ValueError) as info:
            drain(feed)
    assert str(path) in str(info.value)
    assert info.value.row == 25, (info.value.row, str(info.value))
    assert re.search(r"\brow 25\b", str(info.value)), str(info.value)


def test_a_stopped_producer_leaves_every_step_it_made_to_drain():
    """drop_remainder counts the rows of steps made but not delivered: a step the producer
    made while the handoff was full, when the consumer stops at the end of the data (on
    several hosts: at a step the hosts agree to drop), is drained too, not lost."""
    from jax_side.prefetch import END, Prefetcher

    calls: list[int] = []

    def next_items():
        calls.append(1)
        return ["step 1", "step 2"] if len(calls) == 1 else [END]

    p = Prefetcher(1, next_items)
    p.start()
    deadline = time.monotonic() + 10
    while p._handoff.empty():
        assert time.monotonic() < deadline, "the producer never handed over a step"
        time.sleep(0.005)
    assert p.stop(10)
    assert p.drain() == ["step 1", "step 2"]
    assert len(calls) == 1


def test_handoff_holds_at_most_its_size_keeps_order_and_stops():
    """The buffer between HostFeed's assembly thread and the consumer."""
    from jax_side.prefetch import Handoff

    h, stop = Handoff(2), threading.Event()
    put: list[int] = []

    def producer():
        for i in range(40):
            if not h.put(i, stop):
                return
            put.append(i)

    t = threading.Thread(target=producer, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while len(put) < 2:
        assert time.monotonic() < deadline, "the producer never filled the buffer"
        time.sleep(0.005)
    time.sleep(0.05)  # room for a wrong producer to run ahead; a right one stays blocked
    assert len(put) == 2
    assert [h.get(timeout_s=10) for _ in range(40)] == list(range(40))
    t.join(timeout=10)
    with pytest.raises(queue.Empty):
        h.get(timeout_s=0.01)
    # A producer blocked on a full buffer gives up once stopped.
    for i in range(2):
        assert h.put(i, stop)
    t = threading.Thread(target=lambda: put.append(h.put(99, stop)), daemon=True)
    t.start()
    stop.set()
    t.join(timeout=10)
    assert put[-1] is False and [h.get(timeout_s=1), h.get(timeout_s=1)] == [0, 1]


def test_a_producer_ahead_of_a_slow_consumer_polls_at_its_pace_even_after_a_pause():
    """A producer waiting for room looks every eighth of the consumer's shortest recent time
    between batches (1 - 20 ms), not every millisecond: at 40 ms a step, about 8 looks a step
    instead of 40; a pause does not lengthen them."""
    from jax_side.prefetch import Handoff

    h, stop = Handoff(2), threading.Event()
    t = threading.Thread(target=lambda: [h.put(i, stop) for i in range(100)], daemon=True)
    t.start()
    got = []
    for _ in range(6):  # five gaps of at least 40 ms: polls every 5 ms or a little more
        got.append(h.get(timeout_s=10))
        time.sleep(0.04)
    assert 0.005 <= h.poll_s() < 0.01
    polls = h.polls
    for _ in range(8):
        got.append(h.get(timeout_s=10))
        time.sleep(0.04)
    per_step = (h.polls - polls) / 8
    assert per_step <= 12, f"{per_step:.1f} looks for room a step of 40 ms (1 ms polls: 40)"
    # A pause (a checkpoint) does not slow the looks that follow it: the consumer's next
    # steps may be fast again.
    time.sleep(0.3)
    got.append(h.get(timeout_s=10))
    assert h.poll_s() < 0.01
    stop.set()
    assert got == list(range(len(got)))


def test_a_late_wake_up_for_a_batch_already_taken_is_not_taken_for_a_new_one():
    """The producer appends, then sets the event. If it pauses between the two, the consumer
    can take the batch by the fast path, clear the event in its next ``get``, and only then
    see the late set: that ``get`` must go on waiting (and time out), not pop an empty deque."""
    from jax_side.prefetch import Handoff

    class LateSet(threading.Event):
        """Sets itself right after the consumer's next clear: the producer's set for a batch
        already taken, landing in the window between the clear and the wait."""
        late = False

        def clear(self):
            super().clear()
            if self.late:
                self.late = False
                self.set()

    h = Handoff(2)
    h._ready = LateSet()
    h.put_now("step 1")
    assert h.get(timeout_s=1) == "step 1"
    h._ready.late = True
    with pytest.raises(queue.Empty):
        h.get(timeout_s=0.05)
    # ... and a batch that comes while it waits is handed over.
    h._ready.late = True
    threading.Timer(0.05, h.put_now, args=("step 2",)).start()
    assert h.get(timeout_s=10) == "step 2"


@pytest.mark.ray
def test_stats_report_the_live_worker_count_after_the_pool_resizes_itself(
        ray_cluster, config, plan, sharding_1d, reference):
    """The autoscale policy resizes the pool from inside it (``request_resize``), without the
    feed being told; the summary reports the workers the pool has, not the configured count."""
    feed = HostFeed(config, sharding=sharding_1d, backend="ray", workers=3, plan=plan,
                    get_timeout_s=60)
    assert feed.stats()["workers"] == 3  # before the pool starts: the workers it will start

    def shrink(f: HostFeed) -> None:
        if f.counters.steps == 1:
            f._intake.source.request_resize(1)  # what AutoscalePolicy's decision does

    with feed:
        batches = drain(feed, after_each=shrink)
        live = feed.stats()["workers"]
    assert digest_of(batches) == reference["digest"]
    assert live == 1 and feed.stats()["workers"] == 1  # while open, and once closed


def test_the_consumer_thread_makes_the_device_arrays(config, plan, sharding_1d, monkeypatch):
    """The producer thread hands over host rows; ``next`` transfers them, on the thread that
    runs the step: here, passes of a jitted summing step over the 8 devices on every batch.
    XLA:CPU can deadlock such a step's all-reduce when many are in flight, feed or no feed
    (docs/batches.md), and abort the whole process after 40 s: the loop blocks on the total
    every 4 steps."""
    import jax_side.batch_assembly as assembly

    made_on: set[int] = set()
    put = assembly.global_arrays

    def recording_put(*args, **kwargs):
        made_on.add(threading.get_ident())
        return put(*args, **kwargs)

    monkeypatch.setattr(assembly, "global_arrays", recording_put)

    @jax.jit
    def step(total, batch):
        return total + (batch["targets_segmentation"] != 0).sum()

    totals = []
    for _ in range(3):
        feed = HostFeed(config, sharding=sharding_1d, backend="local", plan=plan)
        total = jax.numpy.zeros((), jax.numpy.int32)
        with feed:
            for i, batch in enumerate(feed):
                total = step(total, batch)
                if i % 4 == 3:
                    total.block_until_ready()
        totals.append(int(total))
    assert made_on == {threading.get_ident()}
    assert totals[0] > 0 and totals == [totals[0]] * 3
