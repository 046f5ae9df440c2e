"""HostLocalFeed yields this host's rows as numpy: the rows its devices hold of HostFeed's global
batches, in the same order, with the same state; and FeedDataset puts the feed under grain's
IterDataset transformations, the state restoring exactly through them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grain
import jax
import numpy as np
import pytest
from helpers import free_port, make_config, write_parquet_corpus

from ingest.stream.chunk_format import FIELDS
from jax_side import HostFeed, batch_sharding
from jax_side.grain_dataset import FeedDataset
from jax_side.host_local import HostLocalFeed, fast_forward

ROOT = Path(__file__).resolve().parents[1]
CHILD_TIMEOUT_S = 180  # generous for 2 shared CPUs; a healthy run takes seconds
MAX_STEPS = 200  # far above the runs here: a feed that never ends fails instead of hanging
FEED = dict(seq_len=32, global_batch_size=8, num_streams=4, unit_rows=5, chunk_rows=3,
            workers=2, prefetch=2)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    directory = tmp_path_factory.mktemp("host_local_corpus")
    write_parquet_corpus(directory, n_files=3, docs_per_file=40, row_group_size=7, seed=5)
    return directory


@pytest.fixture(scope="module")
def config(corpus):
    return make_config([corpus], **FEED)


def data_sharding():
    return batch_sharding(jax.make_mesh((len(jax.devices()),), ("data",)), "data")


def run(feed) -> list[dict[str, np.ndarray]]:
    out = []
    with feed:
        for batch in feed:
            out.append({k: np.array(v) for k, v in batch.items()})
            assert len(out) < MAX_STEPS, "the feed did not end"
    return out


def local_rows_of(batch: dict[str, jax.Array]) -> dict[str, np.ndarray]:
    """This process's rows of global arrays, read shard by shard off its devices, in row
    order: what the host-local feed must yield."""
    out = {}
    for name, array in batch.items():
        whole = np.zeros(array.shape, array.dtype)
        rows = set()
        for shard in array.addressable_shards:
            whole[shard.index] = np.asarray(shard.data)
            rows.update(range(*shard.index[0].indices(array.shape[0])))
        out[name] = whole[min(rows):max(rows) + 1]
    return out


@pytest.mark.multidevice
@pytest.mark.parametrize("mesh_shape, spec, rampup", [
    pytest.param((8,), ("data", None), None, id="rows-over-8"),
    pytest.param((4, 2), ("data", "model"), None, id="rows-over-4-tokens-over-2"),
    pytest.param((4, 2), ("data", None), {0: 0.5, 3: 1.0}, id="replicated-rampup"),
])
def test_host_local_rows_are_the_rows_this_host_holds_of_the_global_batches(
        corpus, mesh_shape, spec, rampup):
    extra = {"batch_rampup": rampup} if rampup else {}
    config = make_config([corpus], **{**FEED, **extra})
    mesh = jax.make_mesh(mesh_shape, ("data", "model")[:len(mesh_shape)])
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    global_feed = HostFeed(config, sharding=sharding, backend="local", get_timeout_s=60)
    want, states = [], []
    with global_feed:
        for batch in global_feed:
            want.append(local_rows_of(batch))
            states.append(global_feed.get_state())
            assert len(want) < MAX_STEPS, "the feed did not end"
    local_feed = HostLocalFeed(config, sharding=sharding, backend="local", get_timeout_s=60)
    got = []
    with local_feed:
        for step, batch in enumerate(local_feed):
            assert list(batch) == list(FIELDS)
            rows = local_feed.rows_at(step)
            for name in FIELDS:
                assert isinstance(batch[name], np.ndarray) and batch[name].dtype == np.int32
                assert batch[name].shape == (rows.stop - rows.start, config.seq_len)
            got.append(batch)
            assert local_feed.get_state() == states[step], f"state after step {step}"
    assert len(got) == len(want) >= 8
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for name in FIELDS:
            np.testing.assert_array_equal(g[name], w[name], err_msg=f"step {step} {name}")
    # Some steps carry padding rows (the streams end unevenly): they must match too.
    assert any((b["inputs_segmentation"] == 0).all(axis=1).any() for b in got)


@pytest.mark.multidevice
def test_host_local_resumes_from_a_state_with_the_same_rows(config):
    whole = run(HostLocalFeed(config, sharding=data_sharding(), backend="local",
                              get_timeout_s=60))
    for save_at in (0, 3, 5):
        feed = HostLocalFeed(config, sharding=data_sharding(), backend="local",
                             get_timeout_s=60)
        with feed:
            for _ in range(save_at):
                next(feed)
            state = json.loads(json.dumps(feed.get_state()))
        # A HostFeed state and a HostLocalFeed state mean the same: restore into either.
        for cls in (HostLocalFeed, HostFeed):
            resumed = cls(config, sharding=data_sharding(), backend="local", get_timeout_s=60)
            resumed.set_state(state)
            rest = run(resumed)
            assert len(rest) == len(whole) - save_at
            for step, (g, w) in enumerate(zip(rest, whole[save_at:], strict=True)):
                for name in FIELDS:
                    np.testing.assert_array_equal(
                        g[name], w[name], err_msg=f"{cls.__name__} from {save_at}: "
                                                  f"step {save_at + step} {name}")


@pytest.mark.multidevice
def test_fast_forward_rebuilds_the_state_of_a_step_exactly(config):
    whole = run(HostLocalFeed(config, sharding=data_sharding(), backend="local",
                              get_timeout_s=60))
    states = []
    with HostFeed(config, sharding=data_sharding(), backend="local", get_timeout_s=60) as feed:
        states.append(feed.get_state())
        for _ in feed:
            states.append(feed.get_state())
    last = len(states) - 1
    for step in (0, 5, last):
        assert fast_forward(config, sharding=data_sharding(), step=step) == states[step]
    # From a saved state at an earlier step: the state of the same position (a restored
    # stream's chunk boundaries may differ, so compare the rows that follow).
    for start, step in ((2, 7), (4, last)):
        state = fast_forward(config, sharding=data_sharding(), step=step,
                             state=json.loads(json.dumps(states[start])))
        assert state["step"] == step
        resumed = HostLocalFeed(config, sharding=data_sharding(), backend="local",
                                get_timeout_s=60)
        resumed.set_state(state)
        rest = run(resumed)
        assert len(rest) == len(whole) - step
        for g, w in zip(rest, whole[step:], strict=True):
            for name in FIELDS:
                np.testing.assert_array_equal(g[name], w[name])
    with pytest.raises(ValueError, match=f"ends after step {last}"):
        fast_forward(config, sharding=data_sharding(), step=last + 1, state=states[last - 1])
    with pytest.raises(ValueError, match="at or after"):
        fast_forward(config, sharding=data_sharding(), step=1, state=states[2])

def add_mask(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {**batch, "loss_mask": (batch["targets_segmentation"] != 0).astype(np.float32),
            "inputs": batch["inputs"] + 1}


def check_mapped(got: list[dict[str, np.ndarray]], plain: list[dict[str, np.ndarray]]) -> None:
    assert len(got) == len(plain)
    for step, (g, p) in enumerate(zip(got, plain, strict=True)):
        want = add_mask(p)
        assert sorted(g) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(np.asarray(g[name]), want[name],
                                          err_msg=f"step {step} {name}")


def drain(it) -> list[dict[str, np.ndarray]]:
    out = []
    for batch in it:
        out.append({k: np.array(v) for k, v in batch.items()})
        assert len(out) < MAX_STEPS, "the feed did not end"
    it.close()
    return out


@pytest.mark.multidevice
@pytest.mark.parametrize("host_local", [True, False], ids=["host-local", "global"])
def test_a_map_over_the_feed_dataset_yields_the_feed_batches_transformed(config, host_local):
    plain = run(HostLocalFeed(config, sharding=data_sharding(), backend="local",
                              get_timeout_s=60))
    ds = FeedDataset(config, sharding=data_sharding(), backend="local", host_local=host_local,
                     get_timeout_s=60)
    assert isinstance(ds, grain.IterDataset)
    mapped = ds.map(add_mask)
    check_mapped(drain(iter(mapped)), plain)
    # Every iter is a new pass from step 0.
    check_mapped(drain(iter(mapped)), plain)


@pytest.mark.multidevice
def test_state_restores_exactly_through_grain_datasets_on_the_feed(config):
    ds = grain.experimental.ThreadPrefetchIterDataset(
        FeedDataset(config, sharding=data_sharding(), backend="local", host_local=True,
                    get_timeout_s=60).map(add_mask), prefetch_buffer_size=2)
    whole = drain(iter(ds))
    it = iter(ds)
    for _ in range(4):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    later = [next(it) for _ in range(2)]
    it.set_state(state)  # back, on the same iterator
    again = [next(it) for _ in range(2)]
    it.close()
    # The feed made anew by set_state is host-local too.
    assert all(type(b[name]) is np.ndarray for b in again for name in FIELDS)
    for a, b, w in zip(later, again, whole[4:6], strict=True):
        for name in w:
            np.testing.assert_array_equal(a[name], w[name])
            np.testing.assert_array_equal(b[name], w[name])
    fresh = iter(ds)
    fresh.set_state(state)
    rest = drain(fresh)
    assert len(rest) == len(whole) - 4
    for g, w in zip(rest, whole[4:], strict=True):
        for name in w:
            np.testing.assert_array_equal(g[name], w[name])


@pytest.mark.multidevice
def test_grain_mp_prefetch_on_the_feed_is_refused_naming_the_alternative(config):
    ds = FeedDataset(config, sharding=data_sharding(), backend="local", host_local=True)
    with pytest.raises(ValueError, match="ThreadPrefetchIterDataset"):
        ds.set_slice(slice(0, None, 2))
    from absl import flags

    if not flags.FLAGS.is_parsed():  # grain's mp_prefetch reads absl flags, outside app.run
        flags.FLAGS.mark_as_parsed()
    with pytest.raises(Exception, match="ThreadPrefetchIterDataset"):
        next(iter(ds.map(add_mask).mp_prefetch(grain.MultiprocessingOptions(num_workers=1))))


# -- two JAX processes: each yields its own half of the rows ------------------------------------

HOSTS, DEVICES_PER_HOST = 2, 4


def _child(pid: int, port: str, corpus: str, out: str) -> None:
    """One of two JAX processes: the host-local rows, and its devices' rows of HostFeed's
    global arrays, for every step."""
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=HOSTS,
                               process_id=pid, initialization_timeout=CHILD_TIMEOUT_S)
    config = make_config([corpus], **FEED)
    sharding = data_sharding()
    with HostFeed(config, sharding=sharding, backend="local") as feed:
        held = [local_rows_of(batch) for batch in feed]
    with HostLocalFeed(config, sharding=sharding, backend="local") as feed:
        local = [dict(batch) for batch in feed]
        streams = list(feed.streams)
    np.savez(out, streams=np.array(streams),
             **{f"held_{t}_{f}": b[f] for t, b in enumerate(held) for f in FIELDS},
             **{f"local_{t}_{f}": b[f] for t, b in enumerate(local) for f in FIELDS})


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.multidevice
def test_each_of_two_hosts_yields_the_rows_its_devices_hold(config, corpus, tmp_path):
    whole = run(HostLocalFeed(config, sharding=data_sharding(), backend="local",
                              get_timeout_s=60))  # one process, 8 devices: every row
    port = str(free_port())
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES_PER_HOST}",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    procs = []
    for i in range(HOSTS):
        with open(tmp_path / f"err{i}.txt", "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "child", str(i), port, str(corpus),
                 str(tmp_path / f"out{i}.npz")], cwd=ROOT, env=env, stderr=err,
                stdout=subprocess.DEVNULL))
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    errs = [(tmp_path / f"err{i}.txt").read_text()[-3000:] for i in range(HOSTS)]
    assert [p.returncode for p in procs] == [0, 0], errs
    rows = config.global_batch_size // HOSTS
    for i in range(HOSTS):
        out = np.load(tmp_path / f"out{i}.npz")
        assert list(out["streams"]) == [2 * i, 2 * i + 1]
        for t, w in enumerate(whole):
            for f in FIELDS:
                got = out[f"local_{t}_{f}"]
                np.testing.assert_array_equal(got, out[f"held_{t}_{f}"],
                                              err_msg=f"host {i} step {t} {f}")
                np.testing.assert_array_equal(got, w[f][i * rows:(i + 1) * rows],
                                              err_msg=f"host {i} step {t} {f}")
        assert f"local_{len(whole)}_inputs" not in out


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    _child(int(sys.argv[2]), *sys.argv[3:])
