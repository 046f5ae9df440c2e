"""FeedIterator is a grain.DatasetIterator: grain's orbax handler saves and restores it exactly,
and a loop written for grain's iterators (next, get_state, set_state) runs unchanged on it."""

from __future__ import annotations

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import make_config, write_parquet_corpus

from ingest import step_digest
from jax_side import FeedIterator, batch_sharding

MAX_STEPS = 200  # far above the runs here: a feed that never ends fails instead of hanging
# B=8 over the 8 forced CPU devices, S=4 streams of k=2 rows per step; chunk_rows=3 puts most
# steps inside a chunk, so the saved states carry rows taken from a chunk.
FEED = dict(seq_len=32, global_batch_size=8, num_streams=4, unit_rows=5, chunk_rows=3,
            workers=2, prefetch=2)
BACKENDS = [pytest.param("local", id="local"),
            pytest.param("ray", id="ray", marks=[pytest.mark.ray, pytest.mark.slow])]


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("grain_corpus")
    write_parquet_corpus(corpus, n_files=3, docs_per_file=40, row_group_size=7, seed=11)
    return make_config([corpus], **FEED)


def sharding():
    return batch_sharding(jax.make_mesh((len(jax.devices()),), ("data",)), "data")


def digest(batch: dict[str, jax.Array]) -> str:
    return step_digest({k: np.asarray(v) for k, v in batch.items()})


def run_to_end(it) -> list[str]:
    out = []
    for batch in it:
        out.append(digest(batch))
        assert len(out) < MAX_STEPS, "the feed did not end"
    return out


def new_iterator(config, backend: str) -> FeedIterator:
    return FeedIterator(config, sharding=sharding(), backend=backend, get_timeout_s=60)


@pytest.fixture
def backend(request):
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return request.param


@pytest.mark.multidevice
@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_grain_checkpoint_handler_restores_the_rest_bit_for_bit(config, backend, tmp_path):
    unbroken_it = new_iterator(config, backend)
    try:
        unbroken = run_to_end(unbroken_it)
    finally:
        unbroken_it.close()
    assert len(unbroken) >= 8
    save_at = 5

    manager = ocp.CheckpointManager(tmp_path / "ckpt")
    it = new_iterator(config, backend)
    try:
        seen = []
        # The loop as written for grain: save through grain's handler, keep training.
        for step, batch in enumerate(it, start=1):
            seen.append(digest(batch))
            if step == save_at:
                manager.save(step, args=ocp.args.Composite(
                    data=grain.checkpoint.CheckpointSave(it)))
                manager.wait_until_finished()
            if step == save_at + 2:
                break
    finally:
        it.close()
    assert seen == unbroken[:save_at + 2]

    restored = new_iterator(config, backend)
    try:
        out = manager.restore(save_at, args=ocp.args.Composite(
            data=grain.checkpoint.CheckpointRestore(restored)))
        assert out["data"] is restored
        assert restored.get_state()["step"] == save_at
        rest = run_to_end(restored)
    finally:
        restored.close()
        manager.close()
    assert rest == unbroken[save_at:]


@pytest.mark.multidevice
def test_set_state_while_iterating_goes_back_like_grain_iterators(config):
    it = new_iterator(config, "local")
    try:
        assert isinstance(it, grain.DatasetIterator)
        for _ in range(3):
            next(it)
        state = it.get_state()
        later = [digest(next(it)) for _ in range(4)]
        assert it.get_state()["step"] == 7 and state["step"] == 3  # a copy, not a live view
        it.set_state(state)  # after batches were taken: grain allows it
        again = [digest(next(it)) for _ in range(4)]
        assert again == later
        it.set_state(state)
        assert run_to_end(it)[:4] == later
    finally:
        it.close()
    with pytest.raises(ValueError, match="closed"):
        next(it)


@pytest.mark.multidevice
def test_a_state_from_another_config_is_refused_with_the_difference(config):
    it = new_iterator(config, "local")
    other = new_iterator(make_config(list(config.sources[0].paths), **{**FEED, "seed": 99}),
                         "local")
    try:
        next(other)
        with pytest.raises(ValueError, match="seed"):
            it.set_state(other.get_state())
    finally:
        it.close()
        other.close()
