"""``ingest run --resume`` after a SIGKILL continues with exactly the batches of an unbroken run.

Three real ``ingest run`` processes join the session's Ray cluster: an unbroken 40-step run, a
run killed with SIGKILL right after it logs step 20, and a ``--resume`` of the killed run. The
killed run's digest log is a FIFO, so the test waits on its lines (``select``) instead of
polling a file, and kills the process the moment step 20 arrives.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import write_parquet_corpus

pytestmark = [pytest.mark.slow, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[1]
STEPS = 40
EVERY = 7
KILL_AFTER = 20
RUN_TIMEOUT_S = 300
# The console script of this environment (pyproject's [project.scripts] `ingest`).
INGEST = Path(sys.executable).with_name("ingest")

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
workers: 2
seed: 11
num_epochs: null
"""
# The killed run differs in runtime fields only (same batches): one worker fetching one row per
# call makes its steps slower, which widens the window for the kill to land before step 40,
# and the resume then runs with other workers and chunk sizes than the run it continues.
KILLED_RUN_CONFIG = CONFIG.replace("chunk_rows: 3", "chunk_rows: 1").replace(
    "workers: 2", "workers: 1\nprefetch: 1")


def ingest_run(config: Path, checkpoint_dir: Path, digest_log: Path, address: str,
               *extra: str) -> list[str]:
    assert INGEST.exists(), f"no `ingest` script beside {sys.executable}; pip install -e ."
    return [str(INGEST), "run", str(config), "--steps", str(STEPS),
            "--checkpoint-dir", str(checkpoint_dir), "--checkpoint-every", str(EVERY),
            "--digest-log", str(digest_log), "--address", address, "--no-progress", *extra]


def run_to_end(cmd: list[str], what: str) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the {what} did not finish within {RUN_TIMEOUT_S} s:\n{e.stderr}")
    assert done.returncode == 0, f"the {what} failed:\n{done.stderr[-4000:]}"
    return done


def read_log(path: Path) -> dict[int, str]:
    lines = [line.split() for line in path.read_text().splitlines()]
    steps = [int(s) for s, _ in lines]
    assert steps == sorted(set(steps)), f"{path} repeats or reorders steps: {steps}"
    return {int(s): d for s, d in lines}


class DigestPipe:
    """The read end of a FIFO that a run writes 'STEP DIGEST' lines into."""

    def __init__(self, path: Path):
        os.mkfifo(path)
        # Non-blocking, so opening never waits for a writer that may never come.
        self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self._rest = b""
        self.digests: dict[int, str] = {}
        self.closed = False

    def read(self, timeout: float) -> bool:
        """Reads what arrives within ``timeout`` seconds; False if nothing did."""
        ready, _, _ = select.select([self._fd], [], [], timeout)
        if not ready:
            return False
        data = os.read(self._fd, 1 << 16)
        if not data:  # every writer closed: the run ended or died
            self.closed = True
            return True
        *lines, self._rest = (self._rest + data).split(b"\n")
        for line in lines:
            step, d = line.decode().split()
            self.digests[int(step)] = d
        return True

    def wait_for_step(self, step: int, proc: subprocess.Popen, deadline_s: float) -> None:
        deadline = time.monotonic() + deadline_s
        while step not in self.digests:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"the run did not log step {step} within {deadline_s} s (logged "
                            f"{sorted(self.digests)[-3:]})")
            # Short select timeouts only to notice a run that died without closing the pipe.
            self.read(min(left, 1.0))
            if step not in self.digests and (self.closed or proc.poll() is not None):
                pytest.fail(f"the run ended (exit code {proc.poll()}) before logging step "
                            f"{step}; it logged steps {sorted(self.digests)}")

    def drain(self, deadline_s: float) -> None:
        deadline = time.monotonic() + deadline_s
        while not self.closed:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"the pipe did not close within {deadline_s} s of the kill")
            self.read(left)

    def close(self) -> None:
        os.close(self._fd)


def test_sigkill_then_resume_matches_unbroken_run_and_stops_at_the_same_step(
        ray_cluster, tmp_path):
    write_parquet_corpus(tmp_path / "corpus", n_files=2, docs_per_file=20, row_group_size=10,
                         seed=4)
    config = tmp_path / "feed.yaml"
    config.write_text(CONFIG)

    unbroken_log = tmp_path / "unbroken.log"
    run_to_end(ingest_run(config, tmp_path / "ckpt_unbroken", unbroken_log, ray_cluster),
               "unbroken run")
    unbroken = read_log(unbroken_log)
    assert sorted(unbroken) == list(range(1, STEPS + 1))
    saved = sorted(int(p.name) for p in (tmp_path / "ckpt_unbroken").iterdir()
                   if p.name.isdigit())
    # Every EVERY steps, and at the last step.
    assert saved == sorted(set(range(EVERY, STEPS + 1, EVERY)) | {STEPS})

    checkpoints = tmp_path / "ckpt"
    killed_config = tmp_path / "feed_killed.yaml"
    killed_config.write_text(KILLED_RUN_CONFIG)
    pipe = DigestPipe(tmp_path / "killed.log")
    with open(tmp_path / "killed.err", "w") as err:
        proc = subprocess.Popen(ingest_run(killed_config, checkpoints, tmp_path / "killed.log",
                                           ray_cluster), cwd=ROOT, stdout=err, stderr=err)
    try:
        pipe.wait_for_step(KILL_AFTER, proc, deadline_s=RUN_TIMEOUT_S)
        proc.kill()
        proc.wait(timeout=30)
        pipe.drain(deadline_s=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        pipe.close()
    assert proc.returncode == -9, f"expected death by SIGKILL, got exit code {proc.returncode}"
    killed_at = max(pipe.digests)
    assert killed_at < STEPS, (
        f"the run reached step {STEPS} before the kill landed (the machine is very loaded?)")
    for step, d in pipe.digests.items():
        assert d == unbroken[step], f"the killed run's step {step} differs from the unbroken run"

    resumed_log = tmp_path / "resumed.log"
    done = run_to_end(ingest_run(config, checkpoints, resumed_log, ray_cluster, "--resume",
                                 "--json"), "resumed run")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    restored_at = summary["first_step"]
    assert f"resumed at step {restored_at}" in done.stderr
    assert restored_at % EVERY == 0 and EVERY <= restored_at <= killed_at, (
        f"resumed at step {restored_at}; the killed run logged up to {killed_at} and saved "
        f"every {EVERY} steps")
    print(f"killed after step {killed_at}; resumed at step {restored_at}")
    assert summary["last_step"] == STEPS
    resumed = read_log(resumed_log)
    assert sorted(resumed) == list(range(restored_at + 1, STEPS + 1))
    for step, d in resumed.items():
        assert d == unbroken[step], f"step {step} after resuming at {restored_at} differs"
