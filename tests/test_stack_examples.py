"""The examples of the stack pages (docs/maxtext.md, docs/levanter.md, docs/grain.md) run, and
their restarts continue on exactly the batches of an unbroken run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import make_config, write_parquet_corpus

from ingest import step_digest
from jax_side import HostFeed, batch_sharding

ROOT = Path(__file__).resolve().parents[1]
FEED = dict(seq_len=32, global_batch_size=8, num_streams=4, unit_rows=5, chunk_rows=3,
            workers=2, prefetch=2)


def example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}",
                                                  ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("stack_corpus")
    write_parquet_corpus(corpus, n_files=3, docs_per_file=40, row_group_size=7, seed=11)
    return make_config([corpus], **FEED)


@pytest.fixture(scope="module")
def unbroken(config) -> list[str]:
    sharding = batch_sharding(jax.make_mesh((len(jax.devices()),), ("data",)), "data")
    with HostFeed(config, sharding=sharding, backend="local") as feed:
        return [step_digest({k: np.asarray(v) for k, v in b.items()}) for b in feed]


@pytest.mark.multidevice
@pytest.mark.parametrize("name", ["maxtext_style", "levanter_style"])
def test_the_example_loop_resumes_on_the_unbroken_batches(name, config, unbroken, tmp_path):
    run = example(name).run
    ckpt = str(tmp_path / "ckpt")
    first = run(config, steps=7, checkpoint_dir=ckpt, checkpoint_every=3)
    assert (first["first_step"], first["step"]) == (0, 7)
    assert first["digests"] == unbroken[:7]
    # A restart asked for more steps: it resumes at the latest checkpoint (step 7).
    rest = run(config, steps=len(unbroken) + 5, checkpoint_dir=ckpt, checkpoint_every=3)
    assert rest["first_step"] == 7 and rest["step"] == len(unbroken)
    assert rest["digests"] == unbroken[7:]


@pytest.mark.multidevice
def test_levanter_style_restarts_from_any_step_number(config, unbroken, tmp_path):
    module = example("levanter_style")
    ckpt = str(tmp_path / "ckpt")
    module.run(config, steps=9, checkpoint_dir=ckpt, checkpoint_every=3)
    sharding = batch_sharding(jax.make_mesh((len(jax.devices()),), ("data",)), "data")
    manager = module.checkpoint.open_manager(ckpt)
    try:
        with module.feed_from_step(config, sharding, manager, 3, "local") as feed:
            got = [step_digest({k: np.asarray(v) for k, v in b.items()}) for b in feed]
        # No checkpoint at step 4 or 11: read forward from steps 3 and 9.
        forward = {}
        for step in (4, 11):
            with module.feed_from_step(config, sharding, manager, step, "local") as feed:
                forward[step] = [step_digest({k: np.asarray(v) for k, v in b.items()})
                               for b in feed]
    finally:
        manager.close()
    assert got == unbroken[3:]
    assert forward[4] == unbroken[4:] and forward[11] == unbroken[11:]


@pytest.mark.multidevice
def test_grain_dataset_example_maps_and_restores(config, unbroken):
    module = example("grain_dataset")
    it = iter(module.pipeline(config))
    batches = [next(it) for _ in range(4)]
    state = json.loads(json.dumps(it.get_state()))
    it.close()
    for b in batches:
        np.testing.assert_array_equal(b["loss_mask"], b["targets_segmentation"] != 0)
    assert [step_digest({k: v for k, v in b.items() if k != "loss_mask"})
            for b in batches] == unbroken[:4]
    again = iter(module.pipeline(config))
    again.set_state(state)
    nxt = next(again)
    again.close()
    assert step_digest({k: v for k, v in nxt.items() if k != "loss_mask"}) == unbroken[4]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grain_dataset"])
def test_example_command_runs_on_the_demo_corpus(name):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / f"{name}.py"), "--steps", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                              "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
                              "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "next step 2" in out.stdout


@pytest.mark.slow
def test_training_entry_point_reads_a_config_and_resumes(tmp_path):
    """examples/train.py as the cluster recipes run it: --config, then a restart."""
    write_parquet_corpus(tmp_path / "data", n_files=2, docs_per_file=60, row_group_size=16,
                         seed=3)
    (tmp_path / "corpus.yaml").write_text(
        f"sources:\n  - paths: [{tmp_path / 'data'}]\ntokenizer: gpt2\nseq_len: 32\n"
        f"global_batch_size: 8\nnum_streams: 4\nunit_rows: 8\n")
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    cmd = [sys.executable, str(ROOT / "examples" / "train.py"), "--backend", "local",
           "--config", str(tmp_path / "corpus.yaml"), "--checkpoint-dir", str(tmp_path / "ckpt"),
           "--checkpoint-every", "2", "--dim", "8"]
    first = subprocess.run([*cmd, "--steps", "4"], capture_output=True, text=True, timeout=300,
                           env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "step    4" in first.stdout
    again = subprocess.run([*cmd, "--steps", "6"], capture_output=True, text=True, timeout=300,
                           env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed at step 4" in again.stderr and "step    5" in again.stdout
