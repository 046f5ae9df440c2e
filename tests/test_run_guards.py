"""``ingest run`` refusing what would go wrong silently: a run that delivers nothing, two runs
on one checkpoint directory, a stray step folder, an edited checkpoint on ``--resume``, a Ray
that does not import.

Every run is a real ``ingest run`` subprocess over a small Parquet corpus, with a deadline, on
the local backend (no Ray) except where Ray is the point.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import write_parquet_corpus

from jax_side import checkpoint

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240

CONFIG = """\
sources:
  - paths: [corpus]
    text_column: text
tokenizer: gpt2
seq_len: 32
global_batch_size: 8
num_streams: 4
unit_rows: 5
chunk_rows: 3
seed: 11
num_epochs: 1
on_bad_document: skip
"""


def ingest(*args: str, cwd: Path, backend: str = "local",
           path: tuple[Path, ...] = ()) -> subprocess.CompletedProcess:
    """``ingest run ARGS`` in ``cwd``; ``path``: folders put before the project on the
    subprocess's PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, (*path, ROOT))),
               JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "jax_side.run", "run", *args, "--backend", backend,
           "--no-progress"]
    try:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"`{' '.join(cmd)}` did not finish within {TIMEOUT_S} s: {e.stderr!r}")


def last_json(proc: subprocess.CompletedProcess) -> dict:
    """The --json line: strict JSON (NaN or Infinity would fail to parse here)."""
    line = proc.stdout.strip().splitlines()[-1]
    return json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in the JSON: {line}"))


@pytest.fixture
def job(tmp_path) -> Path:
    (tmp_path / "corpus").mkdir()
    write_parquet_corpus(tmp_path / "corpus", n_files=2, docs_per_file=20, row_group_size=10,
                         seed=4)
    (tmp_path / "config.yaml").write_text(CONFIG)
    return tmp_path


@pytest.fixture
def null_job(tmp_path) -> Path:
    """A corpus whose every document is null, skipped by ``on_bad_document: skip``."""
    (tmp_path / "corpus").mkdir()
    pq.write_table(pa.table({"text": pa.array([None] * 12, pa.string())}),
                   str(tmp_path / "corpus" / "part-0.parquet"), row_group_size=6)
    (tmp_path / "config.yaml").write_text(CONFIG)
    return tmp_path


# -- a run that delivers nothing -------------------------------------------------------------


def test_a_run_that_skips_every_document_says_so_and_fails(null_job):
    proc = ingest("config.yaml", "--json", cwd=null_job)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "the run delivered no batch: 12 document(s) were skipped (null_text" in proc.stderr
    assert "--allow-empty" in proc.stderr
    s = last_json(proc)  # the summary, with the error
    assert s["steps"] == 0 and s["startup_s"] is None
    assert s["exit_status"] == 1 and s["error"].startswith("the run delivered no batch: 12 ")
    assert sum(s["skipped_documents"]["null_text"].values()) == 12
    assert "skipped 12 document(s) as null_text" in proc.stderr


def test_allow_empty_accepts_a_run_that_delivers_nothing(null_job):
    proc = ingest("config.yaml", "--json", "--allow-empty", cwd=null_job)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "delivered no batch" in proc.stderr and "allowed by --allow-empty" in proc.stderr
    assert sum(last_json(proc)["skipped_documents"]["null_text"].values()) == 12


# -- a Ray that does not import --------------------------------------------------------------


@pytest.mark.parametrize("warm_start", [True, False])
def test_a_ray_that_does_not_import_fails_the_run_naming_the_fix(job, tmp_path, warm_start):
    # A Ray wheel built for another Python fails in its own __init__, loading its library.
    broken = tmp_path / "broken-site" / "ray"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text(
        'raise OSError("_raylet.so: undefined symbol: PyUnstable_Code_NewWithPosOnlyArgs")\n')
    args = ("config.yaml",) if warm_start else ("config.yaml", "--no-warm-start")
    proc = ingest(*args, cwd=job, backend="ray", path=(broken.parent,))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (f"Ray does not import in this Python ({sys.executable}): OSError: _raylet.so: "
            f"undefined symbol" in proc.stderr), proc.stderr[-3000:]
    assert "--backend local" in proc.stderr


# -- one run per checkpoint directory --------------------------------------------------------


def test_a_second_run_on_a_locked_checkpoint_directory_is_refused_naming_the_holder(job):
    ckpt = job / "ckpt"
    with checkpoint.lock_directory(ckpt):  # this process holds it, as a running job would
        proc = ingest("config.yaml", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
                      "--json", cwd=job)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"another `ingest run` is using {ckpt}" in proc.stderr
    # --json: the last line of stdout is the error, not a summary.
    error = last_json(proc)
    assert error["exit_status"] == 1 and "steps" not in error
    assert f"another `ingest run` is using {ckpt}" in error["error"]
    assert f"host {socket.gethostname()}, pid {os.getpid()}" in proc.stderr
    assert not any(p.name.isdigit() for p in ckpt.iterdir())  # it saved nothing
    # Released: the same command runs now.
    proc = ingest("config.yaml", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
                  cwd=job)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert any(p.name.isdigit() for p in ckpt.iterdir())


def test_a_stray_step_folder_is_reported_instead_of_stopping_every_save(job):
    ckpt = job / "ckpt"
    (ckpt / "99").mkdir(parents=True)
    proc = ingest("config.yaml", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
                  cwd=job)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "step folder(s) ['99'] that are not complete checkpoints" in proc.stderr
    assert "Remove them" in proc.stderr


# -- an edited checkpoint on --resume --------------------------------------------------------


def test_resume_passes_over_an_edited_latest_checkpoint_naming_it(job):
    ckpt = job / "ckpt"
    first = ingest("config.yaml", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
                   "--steps", "4", "--json", cwd=job)
    assert first.returncode == 0, first.stderr[-3000:]
    bad = ckpt / "4" / "feed" / "process_0-of-1.json"
    saved = json.loads(bad.read_text())
    saved["streams"]["0"]["taken"] += 1  # in range: only the checksum tells
    bad.write_text(json.dumps(saved))
    proc = ingest("config.yaml", "--checkpoint-dir", str(ckpt), "--resume", "--steps", "6",
                  "--json", cwd=job)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{bad} fails its checksum" in proc.stderr
    assert "falling back to the previous checkpoint" in proc.stderr
    assert "resumed at step 2" in proc.stderr
    assert last_json(proc)["first_step"] == 2
