"""Resuming any number of times: a run stopped and resumed 1-4 times, at random steps, gives
every batch of the unbroken run, for every kind of stream (text, mixture, replay of a
materialized directory), with and without a batch ramp-up, on both backends.

A state saved after a resume is itself resumed here, which a single resume never exercises:
a stream that keeps using the state object it was restored from would save positions that
have already moved on.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import assert_resumes_identically_in_chain, make_config, write_parquet_corpus
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec

from actors.materialize_job import materialize_corpus
from ingest import Config, SourceConfig, build_plan, step_digest
from jax_side import HostFeed

# B=16 rows over S=4 streams; the ramp-up gives 4, 8, then 16 rows (k = 1, 2, 4).
FEED = dict(seq_len=32, global_batch_size=16, num_streams=4, unit_rows=5, chunk_rows=24,
            num_epochs=2, seed=5)
RAMP = {0: 0.25, 2: 0.5, 5: 1.0}
KINDS = ("text", "mixture", "replay")
MAX_STEPS = 40


@functools.cache
def _root(tmp_root: str) -> dict[str, Config]:
    """The three configs over small real corpora under ``tmp_root``."""
    root = Path(tmp_root)
    write_parquet_corpus(root / "a", 3, 40, 8, seed=21, min_words=10, max_words=40)
    write_parquet_corpus(root / "b", 2, 20, 8, seed=22, min_words=10, max_words=40)
    text = make_config([root / "a"], **FEED)
    mixture = text.replace(sources=(SourceConfig(paths=(str(root / "a"),), weight=3.0),
                                    SourceConfig(paths=(str(root / "b"),), weight=1.0)))
    out = root / "materialized"
    summary = materialize_corpus(text.replace(num_epochs=1), str(out), backend="local",
                                 segment_rows=7)
    assert summary.complete
    replay = Config.from_dict({"sources": [SourceConfig(paths=(str(out),), kind="materialized")],
                               **FEED})
    return {"text": text, "mixture": mixture, "replay": replay}


class FeedRun:
    """A HostFeed seen as an iterator of step digests with the feed's state pair."""

    def __init__(self, config: Config, plan, backend: str):
        mesh = jax.make_mesh((4, 2), ("data", "model"))
        self.feed = HostFeed(config, sharding=NamedSharding(mesh, PartitionSpec("data")),
                             backend=backend, workers=2, plan=plan)
        self._it = None

    def get_state(self):
        return self.feed.get_state()

    def set_state(self, state):
        self.feed.set_state(state)

    def next_digest(self):
        if self._it is None:
            self._it = iter(self.feed)
        batch = next(self._it, None)
        if batch is None:
            return None
        return np.frombuffer(bytes.fromhex(step_digest(
            {k: np.asarray(v) for k, v in batch.items()})), np.uint8)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    return _root(str(tmp_path_factory.mktemp("resume_chain")))


_REFERENCES: dict[tuple[str, bool, str], tuple] = {}


def _setup(key: tuple[str, bool, str], config: Config, backend: str):
    """The plan and the unbroken run's digests, once per kind, ramp-up and backend."""
    if key in _REFERENCES:
        return _REFERENCES[key]
    plan = build_plan(config)
    run = FeedRun(config, plan, backend)
    try:
        reference = [run.next_digest() for _ in range(MAX_STEPS)]
    finally:
        run.feed.close()
    reference = [d for d in reference if d is not None]
    assert len(reference) >= 8, f"the corpus gave only {len(reference)} steps"
    _REFERENCES[key] = plan, reference
    return plan, reference


def _check_chain(configs, data, kind: str, backend: str) -> None:
    config = configs[kind]
    rampup = data.draw(st.booleans(), label="ramp-up")
    if rampup:
        config = config.replace(batch_rampup=RAMP)
    plan, reference = _setup((kind, rampup, backend), config, backend)
    resume_at = sorted(data.draw(st.sets(st.integers(1, len(reference) - 1), min_size=1,
                                         max_size=4), label="resume at steps"))
    assert_resumes_identically_in_chain(
        lambda: FeedRun(config, plan, backend), resume_at, FeedRun.next_digest,
        reference=reference, max_steps=MAX_STEPS, close=lambda r: r.feed.close())


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_resumed_any_number_of_times_the_local_feed_gives_the_unbroken_batches(configs, kind,
                                                                               data):
    _check_chain(configs, data, kind, "local")


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_resumed_any_number_of_times_the_ray_feed_gives_the_unbroken_batches(ray_cluster,
                                                                             configs, kind,
                                                                             data):
    _check_chain(configs, data, kind, "ray")
