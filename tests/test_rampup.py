"""Batch ramp-up: ``batch_rampup: {step: factor}`` scales ``global_batch_size`` per step.

A ramp-up changes how a stream's rows are batched, never the rows: step t (0-based) takes
k_t = B_t / S rows of every stream. Runs use the local backend on the 8 forced CPU devices, on
a 4 x 2 mesh with rows over ``data`` (so batches of 4 rows fit), and compare with the same
config without a ramp-up and with every resume point of the unbroken run.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from helpers import drain_feed as drain
from helpers import make_config, write_parquet_corpus
from jax.sharding import NamedSharding, PartitionSpec

from ingest import FIELDS, ConfigError, build_plan, step_digest
from jax_side import HostFeed, batch_sharding
from jax_side.iterator_length import steps_covering

# B=16 rows, S=4 streams; factors 0.25, 0.5, 1.0 give 4, 8, 16 rows: k_t = 1, 2, 4.
RAMP = {0: 0.25, 2: 0.5, 5: 1.0}
FEED = dict(seq_len=32, global_batch_size=16, num_streams=4, unit_rows=5, chunk_rows=3,
            num_epochs=1, seed=11)


def rows_of_stream(batches, config, s: int) -> np.ndarray:
    """Stream s's rows in the order the feed delivered them (``[6, n, L]``), padding dropped."""
    parts = []
    for t, b in enumerate(batches):
        k = config.batch_size_at(t) // config.num_streams
        parts.append(np.stack([b[f][s * k:(s + 1) * k] for f in FIELDS]))
    rows = np.concatenate(parts, axis=1)
    real = rows[FIELDS.index("inputs_segmentation")].any(axis=1)
    return rows[:, real]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("rampup_corpus")
    write_parquet_corpus(d, n_files=3, docs_per_file=30, row_group_size=10, seed=4)
    return d


@pytest.fixture(scope="module")
def sharding():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    return NamedSharding(mesh, PartitionSpec("data"))


@pytest.fixture(scope="module")
def ramped(corpus, sharding):
    """The ramped run to the end: config, plan, batches and the state after each step."""
    config = make_config([corpus], batch_rampup=RAMP, **FEED)
    plan = build_plan(config)
    with HostFeed(config, sharding=sharding, backend="local", plan=plan) as feed:
        states = [json.loads(json.dumps(feed.get_state()))]
        batches = []
        for batch in feed:
            batches.append({k: np.asarray(v) for k, v in batch.items()})
            states.append(json.loads(json.dumps(feed.get_state())))
    assert len(batches) >= 8, f"the corpus gave only {len(batches)} steps"
    return config, plan, batches, states


def test_batch_size_is_the_factor_of_the_largest_step_key_at_or_before_it():
    config = make_config(["x"], **dict(FEED, batch_rampup={"3": 0.5, 6: 0.75, 1: 0.25}))
    assert config.batch_rampup == {1: 0.25, 3: 0.5, 6: 0.75}  # keys normalized and sorted
    # Step 0 is the first batch; before the first key the factor is 1.0.
    assert [config.batch_size_at(t) for t in range(8)] == [16, 4, 4, 8, 8, 8, 12, 12]
    assert config.batch_size_at(10**9) == 12  # not accumulated, and kept after the last key


def test_rampup_shapes_follow_the_factor_in_force_at_each_step(ramped, sharding):
    config, plan, _, _ = ramped
    with HostFeed(config, sharding=sharding, backend="local", plan=plan) as feed:
        for t, batch in enumerate(feed):
            want = (config.batch_size_at(t), FEED["seq_len"])
            for name, arr in batch.items():
                assert arr.shape == want, (t, name, arr.shape)
                assert arr.sharding == sharding, (t, name)
                assert arr.dtype == np.int32
    assert [config.batch_size_at(t) for t in range(7)] == [4, 4, 8, 8, 8, 16, 16]


def test_rampup_changes_batching_but_not_any_streams_rows(ramped, corpus, sharding):
    config, plan, batches, _ = ramped
    flat = config.replace(batch_rampup=None)
    with HostFeed(flat, sharding=sharding, backend="local", plan=plan) as feed:
        unramped = drain(feed)
    assert len(unramped) != len(batches)  # a real difference in batching
    for s in range(config.num_streams):
        got, want = rows_of_stream(batches, config, s), rows_of_stream(unramped, flat, s)
        assert got.shape[1] > 0
        np.testing.assert_array_equal(got, want, err_msg=f"stream {s}")
    # The ramped run pads only after a stream has ended: every real row comes first.
    for t, b in enumerate(batches[:-3]):
        assert b["inputs_segmentation"].any(axis=1).all(), f"step {t} has padding"


def test_resume_at_every_step_across_rampup_boundaries_matches_unbroken_run(ramped, sharding):
    config, plan, batches, states = ramped
    digests = [step_digest(b) for b in batches]
    for step, state in enumerate(states):
        feed = HostFeed(config, sharding=sharding, backend="local", plan=plan)
        feed.set_state(json.loads(json.dumps(state)))
        assert feed.get_state() == state
        with feed:
            rest = drain(feed)
        assert [step_digest(b) for b in rest] == digests[step:], f"restored at step {step}"
        if rest:
            assert rest[0]["inputs"].shape[0] == config.batch_size_at(step)


def test_restore_under_another_rampup_names_the_field(ramped, sharding):
    config, plan, _, states = ramped
    other = config.replace(batch_rampup={0: 0.5})
    feed = HostFeed(other, sharding=sharding, backend="local", plan=plan)
    with pytest.raises(ValueError, match="batch_rampup"):
        feed.set_state(states[3])


def test_invalid_rampup_is_refused_listing_every_bad_entry_and_fitting_factors():
    with pytest.raises(ConfigError) as e:
        make_config(["x"], **dict(FEED, batch_rampup={0: 0.3, "100": 0.5, 200: 0.6}))
    (problem,) = e.value.problems
    assert problem.startswith("batch_rampup=")
    for text in ("step 0: factor 0.3 gives 4.8 rows (try 0.25 or 0.5)",
                 "step 200: factor 0.6 gives 9.6 rows (try 0.5 or 0.75)",
                 "divisible by num_streams=4", "multiples of 0.25"):
        assert text in problem, problem
    assert "step 100" not in problem
    with pytest.raises(ConfigError) as e:
        make_config(["x"], **dict(FEED, batch_rampup={-1: 0.5, "x": 1, 3: 0, 4: True}))
    assert len(e.value.problems) == 4, e.value.problems
    with pytest.raises(ConfigError, match=r"batch_rampup=\[0\.5\] must be a mapping"):
        make_config(["x"], **dict(FEED, batch_rampup=[0.5]))


def test_rampup_size_that_does_not_fit_the_mesh_is_refused_when_the_feed_is_built(corpus):
    config = make_config([corpus], batch_rampup={3: 0.25}, **FEED)  # 4 rows on 8 devices
    sharding = batch_sharding(jax.make_mesh((8,), ("data",)), "data")
    with pytest.raises(ValueError, match=r"batch_rampup step 3: global_batch_size=16 x 0.25 = 4 "
                                         r"rows: .*global_batch_size=4 is not divisible by the 8"):
        HostFeed(config, sharding=sharding, backend="local")


def test_steps_covering_counts_rows_over_rampup_segments():
    config = make_config(["x"], **dict(FEED, batch_rampup=RAMP))  # k_t = 1 1 2 2 2 4 4 ...
    assert steps_covering(config, 0) == 0
    assert steps_covering(config, 1) == 1
    assert steps_covering(config, 3) == 3  # 1 + 1 + 1 of 2
    assert steps_covering(config, 3, full=True) == 2
    assert steps_covering(config, 8) == 5  # 1+1+2+2+2
    assert steps_covering(config, 9) == steps_covering(config, 12) == 6
    assert steps_covering(config, 11, full=True) == 5
    # From step 4 on (k = 2, then 4 from step 5): the claim of a host holding 7 rows.
    assert steps_covering(config, 7, start=4) == 3 and steps_covering(config, 7, start=4,
                                                                       full=True) == 2


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_iterator_length_with_rampup_is_exact_for_one_row_per_document(corpus, sharding,
                                                                       drop_remainder):
    config = make_config([corpus], batch_rampup=RAMP, packing="none", long_documents="truncate",
                         drop_remainder=drop_remainder, **FEED)
    with HostFeed(config, sharding=sharding, backend="local") as feed:
        before = feed.iterator_length
        batches = drain(feed)
        after = feed.iterator_length
    assert before.exact and before.steps == len(batches), (before, len(batches))
    assert after.exact and after.steps == len(batches)
    assert feed.dataset_size == 90
