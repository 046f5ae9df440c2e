"""Exact resume through orbax: the feed saved at step k and restored in a fresh HostFeed (new
Ray workers) delivers the same batches k+1..N as an unbroken run.

Each unbroken run saves its state after every step through a real ``ocp.CheckpointManager``;
the tests pick stop points from those states (asserting that a stop point really is what its
name says: mid-chunk, mid-document, at an epoch boundary) and compare per-step digests.

Run as a script (``python tests/test_checkpoint.py child ...``) this module is one JAX process
of the multi-process test.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import free_port, make_config, write_parquet_corpus

from ingest import step_digest
from jax_side import HostFeed, batch_sharding, checkpoint
from jax_side.checkpoint import FeedCheckpointError, FeedRestore, FeedSave

ROOT = Path(__file__).resolve().parents[1]
MAX_STEPS = 200  # far above any run here: a feed that never ends fails instead of hanging
CHILD_TIMEOUT_S = 180

# seq_len 32, B=8 over the 8 forced CPU devices, S=4 so each stream gives k=2 rows per step;
# chunk_rows=3 does not divide 2*k for most k, so most stop points fall inside a chunk.
CONCAT = dict(seq_len=32, global_batch_size=8, num_streams=4, unit_rows=5, chunk_rows=3,
              workers=2, prefetch=2)
# chunk_rows=2 == k: every state is exact (taken == 0), so epochs can be read off the states.
TWO_EPOCHS = dict(CONCAT, num_epochs=2, chunk_rows=2)
# packing_bins=4 with chunks of 3 rows: states stop inside a packing batch.
FIRST_FIT = dict(CONCAT, packing="first_fit", packing_bins=4)


# -- running and resuming --------------------------------------------------------------------


def sharding():
    return batch_sharding(jax.make_mesh((len(jax.devices()),), ("data",)), "data")


def digest(batch: dict[str, jax.Array]) -> str:
    return step_digest({k: np.asarray(v) for k, v in batch.items()})


@dataclasses.dataclass
class UnbrokenRun:
    """A run to the end of the data, saved after every step.

    Attributes:
      config: the config it ran.
      directory: the checkpoint directory (steps 1..N).
      digests: ``digests[i]`` is step i+1's digest.
      states: ``states[i]`` is the host state after step i+1.
    """

    config: Any
    directory: Path
    digests: list[str]
    states: list[dict[str, Any]]

    @property
    def num_steps(self) -> int:
        return len(self.digests)

    def streams_at(self, step: int) -> list[dict[str, Any]]:
        return list(self.states[step - 1]["streams"].values())


def run_unbroken(config, directory: Path) -> UnbrokenRun:
    manager = checkpoint.open_manager(directory)
    digests, states = [], []
    with HostFeed(config, sharding=sharding(), backend="ray") as feed:
        for step, batch in enumerate(itertools.islice(feed, MAX_STEPS), start=1):
            digests.append(digest(batch))
            state = feed.get_state()
            assert state["step"] == step
            states.append(state)
            manager.save(step, args=ocp.args.Composite(feed=FeedSave(state)))
    manager.wait_until_finished()
    manager.close()
    assert 10 <= len(digests) < MAX_STEPS, f"the corpus gave {len(digests)} steps"
    return UnbrokenRun(config, directory, digests, states)


def resume(config, directory: Path, step: int, **feed_kwargs) -> list[str]:
    """Digests of every batch after restoring ``step`` from ``directory`` in a fresh feed."""
    manager = checkpoint.open_manager(directory)
    state = checkpoint.restore_feed(manager, step)
    manager.close()
    with HostFeed(config, sharding=sharding(), backend="ray", **feed_kwargs) as feed:
        feed.set_state(state)
        assert feed.get_state()["step"] == step
        return [digest(b) for b in itertools.islice(feed, MAX_STEPS)]


def assert_resumes_like_unbroken(run: UnbrokenRun, step: int, config=None, **feed_kwargs):
    rest = resume(config or run.config, run.directory, step, **feed_kwargs)
    assert len(rest) == run.num_steps - step, (
        f"restored at step {step}: {len(rest)} steps followed, the unbroken run had "
        f"{run.num_steps - step} more")
    for i, (got, want) in enumerate(zip(rest, run.digests[step:], strict=True)):
        assert got == want, f"restored at step {step}: step {step + i + 1} differs"


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """4 Parquet files of 40 documents (row groups of 10): about 16 steps of CONCAT."""
    directory = tmp_path_factory.mktemp("corpus")
    write_parquet_corpus(directory, n_files=4, docs_per_file=40, row_group_size=10, seed=3)
    return directory


@pytest.fixture(scope="module")
def concat_run(ray_cluster, corpus, tmp_path_factory) -> UnbrokenRun:
    return run_unbroken(make_config([corpus], **CONCAT), tmp_path_factory.mktemp("ckpt_concat"))


@pytest.fixture(scope="module")
def two_epoch_run(ray_cluster, tmp_path_factory) -> UnbrokenRun:
    directory = tmp_path_factory.mktemp("corpus_small")
    write_parquet_corpus(directory, n_files=4, docs_per_file=20, row_group_size=10, seed=5)
    return run_unbroken(make_config([directory], **TWO_EPOCHS),
                        tmp_path_factory.mktemp("ckpt_epochs"))


@pytest.fixture(scope="module")
def first_fit_run(ray_cluster, corpus, tmp_path_factory) -> UnbrokenRun:
    return run_unbroken(make_config([corpus], **FIRST_FIT),
                        tmp_path_factory.mktemp("ckpt_first_fit"))


def mid_chunk_step(run: UnbrokenRun) -> int:
    """A step (past the first) where every stream stopped inside a chunk."""
    k = run.config.rows_per_stream
    for step in range(2, run.num_steps):
        if (step * k) % run.config.runtime.chunk_rows and all(
                s["taken"] > 0 for s in run.streams_at(step)):
            return step
    raise AssertionError("no step stops inside a chunk; change chunk_rows")


def mid_document_step(run: UnbrokenRun) -> int:
    """A step at a chunk boundary (exact state) where some stream stopped inside a document."""
    for step in range(2, run.num_steps):
        streams = run.streams_at(step)
        if all(s["taken"] == 0 for s in streams) and any(
                s["state"]["offset"] > 0 and not s["state"]["exhausted"] for s in streams):
            return step
    raise AssertionError("no step stops inside a document; change the corpus")


# -- resuming at every kind of stop point ----------------------------------------------------


@pytest.mark.ray
@pytest.mark.parametrize("stop", ["first_step", "mid_chunk", "mid_document", "last_step"])
def test_resume_concat_matches_unbroken_run(concat_run, stop):
    step = {"first_step": lambda r: 1, "mid_chunk": mid_chunk_step,
            "mid_document": mid_document_step, "last_step": lambda r: r.num_steps}[stop](concat_run)
    assert_resumes_like_unbroken(concat_run, step)


@pytest.mark.ray
@pytest.mark.parametrize("after_boundary", [0, 1])
def test_resume_at_epoch_boundary_matches_unbroken_run(two_epoch_run, after_boundary):
    run = two_epoch_run
    epochs = [[s["state"]["epoch"] for s in run.streams_at(step)]
              for step in range(1, run.num_steps + 1)]
    last_of_epoch_0 = max(i + 1 for i, e in enumerate(epochs) if all(x == 0 for x in e))
    assert any(x == 1 for x in epochs[last_of_epoch_0]), "step after it enters epoch 1"
    assert last_of_epoch_0 + after_boundary < run.num_steps
    assert_resumes_like_unbroken(run, last_of_epoch_0 + after_boundary)


@pytest.mark.ray
def test_resume_first_fit_inside_a_packing_batch_matches_unbroken_run(first_fit_run):
    run = first_fit_run
    step = next((s for s in range(2, run.num_steps) if all(
        st["taken"] > 0 and st["state"]["batch_rows_taken"] > 0 for st in run.streams_at(s))),
        None)
    assert step is not None, "no step stops inside a chunk and a packing batch"
    assert_resumes_like_unbroken(run, step)


@pytest.mark.ray
@pytest.mark.parametrize("runtime", [dict(workers=1, chunk_rows=5, prefetch=1),
                                     dict(workers=3, chunk_rows=2, prefetch=3)])
def test_resume_with_other_workers_chunk_rows_and_prefetch_gives_identical_batches(
        concat_run, runtime):
    config = concat_run.config.replace(**runtime)
    assert config.fingerprint() == concat_run.config.fingerprint()
    assert_resumes_like_unbroken(concat_run, mid_chunk_step(concat_run), config)


@pytest.mark.ray
def test_restore_from_step_zero_state_replays_the_whole_run(concat_run, tmp_path):
    with HostFeed(concat_run.config, sharding=sharding(), backend="ray") as feed:
        initial = feed.get_state()
    manager = checkpoint.open_manager(tmp_path)
    checkpoint.save_feed(manager, 0, initial)
    manager.wait_until_finished()
    assert checkpoint.restore_latest_feed(manager) == initial
    assert resume(concat_run.config, tmp_path, 0) == concat_run.digests


# -- refusing to resume under a different config or corpus -----------------------------------


@pytest.mark.ray
@pytest.mark.parametrize("change", [dict(seq_len=64), dict(tokenizer="cl100k"),
                                    dict(num_streams=8), dict(seed=8),
                                    dict(global_batch_size=16)])
def test_restore_under_changed_config_names_the_change(concat_run, change):
    manager = checkpoint.open_manager(concat_run.directory)
    state = checkpoint.restore_latest_feed(manager)
    (field, value), = change.items()
    config = concat_run.config.replace(**change)
    feed = HostFeed(config, sharding=sharding(), backend="ray")
    with pytest.raises(ValueError, match=f"{field}: checkpoint has .*, config has {value!r}"):
        feed.set_state(state)
    feed.close()


@pytest.mark.ray
@pytest.mark.parametrize("edit", ["file_added", "file_rewritten"])
def test_restore_over_changed_corpus_is_refused(ray_cluster, tmp_path, edit):
    directory = tmp_path / "corpus"
    write_parquet_corpus(directory, n_files=2, docs_per_file=20, row_group_size=10, seed=9)
    config = make_config([directory], **CONCAT)
    manager = checkpoint.open_manager(tmp_path / "ckpt")
    with HostFeed(config, sharding=sharding(), backend="ray") as feed:
        next(feed)
        checkpoint.save_feed(manager, 1, feed.get_state())
    manager.wait_until_finished()
    if edit == "file_added":
        write_parquet_corpus(tmp_path / "more", n_files=1, docs_per_file=5, row_group_size=5,
                             seed=10)
        shutil.copy(tmp_path / "more" / "part-00000.parquet", directory / "part-00009.parquet")
    else:
        write_parquet_corpus(directory, n_files=1, docs_per_file=21, row_group_size=10, seed=9)
    state = checkpoint.restore_latest_feed(manager)
    feed = HostFeed(config, sharding=sharding(), backend="ray")
    with pytest.raises(ValueError, match="the corpus changed"):
        feed.set_state(state)
    feed.close()


@pytest.mark.parametrize("copy", ["same", "file_rewritten", "files_renamed"])
def test_a_corpus_moved_elsewhere_restores_only_if_its_files_are_the_same(tmp_path, copy,
                                                                           caplog):
    # A corpus copied to another place (another bucket, a local mirror) with the config's
    # paths changed to it must continue exactly; a copy whose files differ must not.
    old = tmp_path / "bucket" / "corpus"
    write_parquet_corpus(old, n_files=3, docs_per_file=20, row_group_size=10, seed=9)
    config = make_config([old], **CONCAT)
    with HostFeed(config, sharding=sharding(), backend="local") as feed:
        digests = [digest(b) for b in feed]
    with HostFeed(config, sharding=sharding(), backend="local") as feed:
        for _ in range(2):
            next(feed)
        # Through JSON, as from a checkpoint file.
        state = json.loads(json.dumps(feed.get_state()))
    new = tmp_path / "mirror" / "data"
    shutil.copytree(old, new)
    if copy == "file_rewritten":
        write_parquet_corpus(new, n_files=1, docs_per_file=20, row_group_size=10, seed=10)
    elif copy == "files_renamed":  # the same files, in another order
        (new / "part-00000.parquet").rename(new / "part-00009.parquet")
    moved = config.replace(sources=(dataclasses.replace(config.sources[0], paths=(str(new),)),))
    feed = HostFeed(moved, sharding=sharding(), backend="local")
    if copy != "same":
        with pytest.raises(ValueError, match=r"sources: checkpoint has .*the corpus changed"):
            feed.set_state(state)
        feed.close()
        return
    with caplog.at_level(logging.WARNING, logger="jax_side.host_state"):
        feed.set_state(state)
    assert f"the corpus moved (sources[].paths [['{old}']] in the checkpoint" in caplog.text
    with feed:
        assert [digest(b) for b in feed] == digests[2:]
    # A checkpoint from before the content fingerprint was saved says why it cannot.
    del state["corpus_content"]
    feed = HostFeed(moved, sharding=sharding(), backend="local")
    with pytest.raises(ValueError, match="restores only from checkpoints saved with its content"):
        feed.set_state(state)
    feed.close()


# -- files on disk, corruption and fallback --------------------------------------------------


@pytest.mark.ray
def test_each_process_writes_its_own_json_file_beside_orbax_metadata(concat_run):
    feed_dir = concat_run.directory / "1" / checkpoint.FEED_ITEM
    assert sorted(p.name for p in feed_dir.glob("process_*")) == ["process_0-of-1.json"]
    saved = json.loads((feed_dir / "process_0-of-1.json").read_text())
    # The state, and beside it the SHA-256 of its canonical JSON.
    digest = saved.pop(checkpoint.CHECKSUM_KEY)
    assert saved == concat_run.states[0]
    canonical = json.dumps(saved, sort_keys=True, separators=(",", ":"))
    assert digest == hashlib.sha256(canonical.encode()).hexdigest()


@pytest.mark.ray
def test_model_and_feed_save_and_restore_in_one_step_directory(concat_run, tmp_path):
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    manager = checkpoint.open_manager(tmp_path)
    manager.save(5, args=ocp.args.Composite(model=ocp.args.StandardSave(params),
                                            feed=FeedSave(concat_run.states[4])))
    manager.wait_until_finished()
    assert {"model", "feed"} <= {p.name for p in (tmp_path / "5").iterdir()}
    fresh = checkpoint.open_manager(tmp_path)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, params)
    restored = fresh.restore(5, args=ocp.args.Composite(model=ocp.args.StandardRestore(abstract),
                                                        feed=FeedRestore()))
    np.testing.assert_array_equal(restored["model"]["w"], params["w"])
    assert restored["feed"] == concat_run.states[4]
    assert checkpoint.restore_latest_feed(fresh) == concat_run.states[4]


def copy_steps(run: UnbrokenRun, destination: Path, last: int) -> Path:
    """A copy of the run's checkpoint directory holding steps 1..last only."""
    shutil.copytree(run.directory, destination)
    for step in range(last + 1, run.num_steps + 1):
        shutil.rmtree(destination / str(step))
    return destination


CORRUPTIONS = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]),
    "not_utf8": lambda p: p.write_bytes(b"\xff\xfe\x00garbage"),
    "not_a_feed_state": lambda p: p.write_text("[1, 2, 3]"),
    "stream_entry_malformed": lambda p: p.write_text(json.dumps(
        dict(json.loads(p.read_text()), streams={"0": {"state": None}}))),
    "deleted": lambda p: p.unlink(),
}


@pytest.mark.ray
@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_unreadable_process_file_is_reported_and_the_previous_step_restores(
        concat_run, tmp_path, caplog, corruption):
    last = mid_chunk_step(concat_run) + 1
    directory = copy_steps(concat_run, tmp_path / "ckpt", last)
    bad = directory / str(last) / checkpoint.FEED_ITEM / "process_0-of-1.json"
    CORRUPTIONS[corruption](bad)
    manager = checkpoint.open_manager(directory)

    with pytest.raises(FeedCheckpointError, match=f"checkpoint step {last}") as e:
        checkpoint.restore_feed(manager, last)
    assert e.value.step == last
    named = str(bad) if corruption != "deleted" else str(bad.parent)
    assert named in str(e.value)

    with caplog.at_level(logging.WARNING, logger="jax_side.checkpoint"):
        state = checkpoint.restore_latest_feed(manager)
    assert state == concat_run.states[last - 2]
    warnings = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert f"checkpoint step {last}" in warnings and named in warnings
    assert "falling back to the previous checkpoint" in warnings


@pytest.mark.ray
def test_truncated_latest_file_falls_back_and_resumes_identically(concat_run, tmp_path):
    last = mid_document_step(concat_run) + 1
    directory = copy_steps(concat_run, tmp_path / "ckpt", last)
    bad = directory / str(last) / checkpoint.FEED_ITEM / "process_0-of-1.json"
    CORRUPTIONS["truncated"](bad)
    state = checkpoint.restore_latest_feed(checkpoint.open_manager(directory))
    assert state["step"] == last - 1
    run = dataclasses.replace(concat_run, directory=directory)
    assert_resumes_like_unbroken(run, state["step"])


@pytest.mark.ray
def test_every_step_unreadable_is_an_error_and_an_empty_directory_is_none(concat_run, tmp_path):
    assert checkpoint.restore_latest_feed(checkpoint.open_manager(tmp_path / "empty")) is None
    directory = copy_steps(concat_run, tmp_path / "ckpt", 2)
    for step in (1, 2):
        CORRUPTIONS["truncated"](directory / str(step) / "feed" / "process_0-of-1.json")
    with pytest.raises(FeedCheckpointError, match="none of the 2 checkpoint steps"):
        checkpoint.restore_latest_feed(checkpoint.open_manager(directory))


# -- several hosts: files merged on restore --------------------------------------------------


def split_into_process_files(feed_dir: Path, state: dict[str, Any], parts: list[list[str]]):
    """Rewrites a one-process feed item as ``len(parts)`` process files (stream ids per part)."""
    (feed_dir / "process_0-of-1.json").unlink()
    n = len(parts)
    for i, ids in enumerate(parts):
        part = dict(state, streams={s: state["streams"][s] for s in ids})
        (feed_dir / f"process_{i}-of-{n}.json").write_text(json.dumps(part))


@pytest.mark.ray
def test_files_of_two_hosts_merge_into_one_state(concat_run, tmp_path):
    step = mid_chunk_step(concat_run)
    directory = copy_steps(concat_run, tmp_path / "ckpt", step)
    state = concat_run.states[step - 1]
    split_into_process_files(directory / str(step) / "feed", state, [["0", "1"], ["2", "3"]])
    merged = checkpoint.restore_feed(checkpoint.open_manager(directory), step)
    assert merged == state


@pytest.mark.ray
@pytest.mark.parametrize("defect, message", [
    ("missing_process", r"incomplete: expected 2 files .* missing \['process_1-of-2.json'\]"),
    ("other_step", r"disagree on 'step'"),
    ("one_without_content", r"disagree on 'corpus_content': .* has None"),
    ("stream_twice", r"stream 1 is saved differently"),
    ("mixed_counts", r"mixes files of different process counts \[2, 3\]"),
])
def test_inconsistent_process_files_are_reported(concat_run, tmp_path, defect, message):
    step = mid_chunk_step(concat_run)
    directory = copy_steps(concat_run, tmp_path / "ckpt", step)
    feed_dir = directory / str(step) / "feed"
    state = concat_run.states[step - 1]
    split_into_process_files(feed_dir, state, [["0", "1"], ["2", "3"]])
    one = feed_dir / "process_1-of-2.json"
    if defect == "missing_process":
        one.unlink()
    elif defect == "other_step":
        one.write_text(json.dumps(dict(json.loads(one.read_text()), step=step + 1)))
    elif defect == "one_without_content":
        saved = json.loads(one.read_text())
        del saved["corpus_content"]
        one.write_text(json.dumps(saved))
    elif defect == "stream_twice":
        other = dict(state["streams"]["1"], taken=state["streams"]["1"]["taken"] + 1)
        one.write_text(json.dumps(dict(json.loads(one.read_text()),
                                       streams={"1": other, "2": state["streams"]["2"]})))
    else:
        (feed_dir / "process_2-of-3.json").write_text(one.read_text())
    with pytest.raises(FeedCheckpointError, match=message):
        checkpoint.restore_feed(checkpoint.open_manager(directory), step)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_hosts_resume_a_one_host_checkpoint_and_one_host_resumes_theirs(
        concat_run, corpus, tmp_path):
    """1 host saves at k1; 2 JAX processes (4 devices each) restore it, run to k2 and save two
    process files; 1 host restores those and finishes. Every step matches the unbroken run."""
    k1 = mid_chunk_step(concat_run)
    k2 = k1 + 4
    assert k2 < concat_run.num_steps
    saved = tmp_path / "ckpt_two_hosts"
    port = free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    args = [str(corpus), json.dumps(CONCAT), str(concat_run.directory), str(k1), str(k2),
            str(saved)]
    procs = [subprocess.Popen([sys.executable, __file__, "child", str(i), str(port), *args,
                               str(tmp_path / f"out{i}.json")], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=CHILD_TIMEOUT_S)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for i, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
    results = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]
    assert [r["streams"] for r in results] == [[0, 1], [2, 3]]
    for r in results:
        assert r["digests"] == concat_run.digests[k1:k2]
    files = sorted(p.name for p in (saved / str(k2) / "feed").glob("process_*"))
    assert files == ["process_0-of-2.json", "process_1-of-2.json"]
    merged = checkpoint.restore_feed(checkpoint.open_manager(saved), k2)
    assert merged["step"] == k2 and sorted(merged["streams"]) == ["0", "1", "2", "3"]
    assert_resumes_like_unbroken(dataclasses.replace(concat_run, directory=saved), k2)


def _child(argv: list[str]) -> None:
    """One of two JAX processes: restore ``k1`` from ``src``, run to ``k2``, save in ``dst``."""
    from jax.experimental import multihost_utils

    pid, port, corpus, overrides, src, k1, k2, dst, out = argv
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=int(pid), initialization_timeout=CHILD_TIMEOUT_S)
    config = make_config([corpus], **json.loads(overrides))
    feed = HostFeed(config, sharding=sharding(), backend="local")
    feed.set_state(checkpoint.restore_feed(checkpoint.open_manager(src), int(k1)))
    digests = []
    for batch in itertools.islice(feed, int(k2) - int(k1)):
        full = multihost_utils.process_allgather(batch, tiled=True)
        digests.append(step_digest(full))
    manager = checkpoint.open_manager(dst)
    checkpoint.save_feed(manager, int(k2), feed.get_state())
    manager.wait_until_finished()
    feed.close()
    Path(out).write_text(json.dumps({"streams": list(feed.streams), "digests": digests}))


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    _child(sys.argv[2:])


# -- checksums and field validation ----------------------------------------------------------


@pytest.mark.ray
def test_process_files_carry_a_checksum_and_an_edited_one_is_refused(concat_run, tmp_path,
                                                                       caplog):
    last = mid_chunk_step(concat_run) + 1
    directory = copy_steps(concat_run, tmp_path / "ckpt", last)
    bad = directory / str(last) / checkpoint.FEED_ITEM / "process_0-of-1.json"
    saved = json.loads(bad.read_text())
    assert len(saved.pop(checkpoint.CHECKSUM_KEY)) == 64
    assert saved == concat_run.states[last - 1]
    # An edit inside every range: the checksum alone tells.
    saved["streams"]["1"]["taken"] += 1
    bad.write_text(json.dumps(dict(saved, sha256=json.loads(bad.read_text())["sha256"])))
    manager = checkpoint.open_manager(directory)
    with pytest.raises(FeedCheckpointError, match=f"{bad} fails its checksum"):
        checkpoint.restore_feed(manager, last)
    with caplog.at_level(logging.WARNING, logger="jax_side.checkpoint"):
        assert checkpoint.restore_latest_feed(manager) == concat_run.states[last - 2]
    assert f"{bad} fails its checksum" in caplog.text


@pytest.mark.ray
def test_a_checkpoint_without_checksum_restores_and_resumes_identically(concat_run, tmp_path):
    step = mid_chunk_step(concat_run)
    directory = copy_steps(concat_run, tmp_path / "ckpt", step)
    path = directory / str(step) / checkpoint.FEED_ITEM / "process_0-of-1.json"
    saved = json.loads(path.read_text())
    del saved[checkpoint.CHECKSUM_KEY]
    path.write_text(json.dumps(saved))
    run = dataclasses.replace(concat_run, directory=directory)
    assert_resumes_like_unbroken(run, step)


def _edit(state: dict[str, Any], sid: str, **changes: Any) -> dict[str, Any]:
    """A copy of ``state`` with stream ``sid``'s entry (``taken``) or stream state changed,
    or ``step`` moved on by ``step``."""
    state = json.loads(json.dumps(state))
    entry = state["streams"][sid]
    for key, value in changes.items():
        if key in ("taken", "documents"):
            entry[key] = value
        elif key == "step":
            state["step"] += value
        else:
            entry["state"][key] = value
    return state


@pytest.mark.ray
@pytest.mark.parametrize("change, message", [
    (dict(epoch=3), r"stream 0: state.epoch=3 is outside 0..0 \(num_epochs=1\)"),
    (dict(offset=-5), r"stream 0: state.offset=-5 is outside an integer >= 0"),
    (dict(doc=100000), r"stream 0: state.doc=100000 is outside 0..5 \(unit \d+ of epoch 0 "
                       r"has 5 document\(s\)\)"),
    (dict(unit=99), r"stream 0: state.unit=99 is outside 0..\d+ \(the stream has \d+ "
                    r"unit\(s\) in epoch 0\)"),
    (dict(taken=500), r"stream 0: state.rows_emitted \+ taken = \d+ rows given, but \d+ "
                      r"steps take \d+ rows"),
    (dict(taken=-1), r"stream 0: taken=-1 is outside"),
    (dict(rows_emitted=1), r"stream 0: state.rows_emitted \+ taken"),
    (dict(step=1), r"stream 0: state.rows_emitted \+ taken = \d+ rows given, but \d+ steps"),
    (dict(exhausted="yes"), r"stream 0: state.exhausted='yes' is not true or false"),
    (dict(skipped={"null_text": {"a.parquet": -2}}), r"state.skipped\['null_text'\]"),
])
def test_out_of_range_fields_are_refused_naming_stream_field_value_and_range(
        concat_run, change, message):
    step = mid_document_step(concat_run)
    state = _edit(concat_run.states[step - 1], "0", **change)
    with HostFeed(concat_run.config, sharding=sharding(), backend="local") as feed:
        with pytest.raises(ValueError, match=message) as e:
            feed.set_state(state)
    assert "edited or corrupted" in str(e.value)
    with HostFeed(concat_run.config, sharding=sharding(), backend="local") as feed:
        feed.set_state(concat_run.states[step - 1])  # the saved state itself restores


@pytest.mark.ray
def test_every_saved_state_of_a_run_passes_validation(concat_run, two_epoch_run, first_fit_run):
    from ingest import build_plan

    for run in (concat_run, two_epoch_run, first_fit_run):
        plan = build_plan(run.config)
        for state in run.states:
            checkpoint.validate_state(state, run.config, plan)


def test_a_stray_step_folder_is_refused_when_the_manager_opens(tmp_path):
    (tmp_path / "ckpt" / "7").mkdir(parents=True)
    (tmp_path / "ckpt" / "notes").mkdir()  # not a step: orbax ignores it, and so does this
    with pytest.raises(FeedCheckpointError, match=r"step folder\(s\) \['7'\] that are not "
                                                  r"complete checkpoints"):
        checkpoint.open_manager(tmp_path / "ckpt")


@pytest.mark.ray
def test_a_relative_checkpoint_directory_saves_and_restores(concat_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    manager = checkpoint.open_manager("ckpt", max_to_keep=2)
    checkpoint.save_feed(manager, 4, concat_run.states[3])
    manager.wait_until_finished()
    assert (tmp_path / "ckpt" / "4").is_dir()
    assert checkpoint.restore_latest_feed(checkpoint.open_manager("ckpt")) == concat_run.states[3]
