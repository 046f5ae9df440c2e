"""The ``ingest run`` command, run as a real subprocess against the session's Ray cluster.

Each run reads a YAML config and a small Parquet corpus written under ``tmp_path``, feeds a
mesh of the 8 forced CPU devices, and prints its summary as JSON on the last stdout line. The
digests it reports are checked against the same feed run in this process. Every subprocess has
a deadline: a hang fails the test with the command and whatever it printed.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import jax
import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from ingest import BatchDigest, load_config, step_digest
from jax_side import HostFeed, batch_sharding
from jax_side.run_summary import summary_lines
from tests import helpers

TIMEOUT_S = 240  # a healthy run here takes a few seconds; 2 CPUs may be shared with other tests
STEPS = 5

WORDS = ("the quick brown fox jumps over a lazy dog near old stone bridge under grey sky while "
         "people walk to market with bread apples cheese fresh fish and children laugh").split()

CONFIG = {
    "sources": [{"paths": ["corpus"], "text_column": "text"}],  # relative to the YAML file
    "tokenizer": "gpt2",
    "seq_len": 32,
    "global_batch_size": 16,  # divisible by the 8 devices the command puts on its mesh
    "num_streams": 8,
    "unit_rows": 10,
    "chunk_rows": 3,
    "seed": 3,
    "num_epochs": 1,
}


# -- running the command ------------------------------------------------------------------


ROOT = Path(__file__).resolve().parent.parent


def entry_point(script: str = "ingest") -> tuple[str, str]:
    """A console script's ``(module, function)``, as pyproject.toml declares it (read here,
    so that a stale script in the venv cannot hide a change): ``ingest`` or ``ingest-dev``
    (the same command with run's development and simulation flags)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        target = tomllib.load(f)["project"]["scripts"][script]
    module, _, function = target.partition(":")
    return module, function


def ingest_command(script: str = "ingest") -> list[str]:
    """Runs the declared console-script function with this interpreter."""
    module, function = entry_point(script)
    return [sys.executable, "-c",
            f"import sys; from {module} import {function}; sys.exit({function}())"]


def call_main(argv: list[str], script: str = "ingest") -> int | str | None:
    """Calls the console-script function in this process; its exit status."""
    module, function = entry_point(script)
    try:
        return getattr(importlib.import_module(module), function)(argv)
    except SystemExit as e:
        return e.code


def cli_env(cache_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update({
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "RAY_AUTH_MODE": "disabled",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "INGEST_CACHE_DIR": str(cache_dir),
    })
    return env


def run_cli(args: list[str], *, cache_dir: Path, cwd: Path | None = None,
            script: str = "ingest", env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
    cmd = ingest_command(script) + args
    try:
        return subprocess.run(cmd, env=env or cli_env(cache_dir), cwd=cwd, capture_output=True,
                              text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        def text(x):
            return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
        pytest.fail(f"`{' '.join(cmd)}` did not finish within {TIMEOUT_S} s (a hang?)\n"
                    f"stdout tail:\n{text(e.stdout)[-2000:]}\nstderr tail:\n"
                    f"{text(e.stderr)[-2000:]}")


def summary(proc: subprocess.CompletedProcess) -> dict[str, Any]:
    """The JSON summary on the last stdout line of a successful run."""
    assert proc.returncode == 0, (f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
                                  f"stderr:\n{proc.stderr[-3000:]}")
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no stdout; stderr:\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


# -- fixtures -----------------------------------------------------------------------------


def make_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Doc{seed}x{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30)))
            + "." for i in range(n)]


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """A folder holding ``config.yaml`` and its ``corpus/`` of four Parquet files."""
    root = tmp_path_factory.mktemp("cli_job")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(4):
        pq.write_table(pa.table({"text": make_texts(60, 40 + i)}),
                       str(corpus / f"part-{i:05d}.parquet"), row_group_size=20)
    (root / "config.yaml").write_text(yaml.safe_dump(CONFIG), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ingest_cache")


@pytest.fixture(scope="module")
def in_process(job) -> dict[str, Any]:
    """The same feed in this process (local backend, 1-D mesh of all devices, like the
    command): per-step digests and the running digest after ``STEPS`` steps and at the end."""
    assert len(jax.devices()) == 8
    cfg = load_config(str(job / "config.yaml"))
    sharding = batch_sharding(jax.make_mesh((8,), ("data",)), "data")
    steps, running, first = [], BatchDigest(), None
    with HostFeed(cfg, sharding=sharding, backend="local") as feed:
        for batch in feed:
            host = {k: np.asarray(v) for k, v in batch.items()}
            steps.append(step_digest(host))
            running.update(host)
            if running.steps == STEPS:
                first = running.hexdigest()
        stats = feed.stats()
    assert len(steps) > STEPS, "the corpus should last longer than the runs' --steps"
    return {"step_digests": steps, "digest_first": first, "digest_all": running.hexdigest(),
            "stats": stats}


@pytest.fixture(scope="module")
def cli_run(ray_cluster, job, cache_dir, tmp_path_factory):
    """``cli_run(backend, workers)``: runs ``ingest run config.yaml --steps STEPS ...`` once per
    variant (cached) with ``--digest --json --digest-log``; returns (summary, digest log)."""
    done: dict[tuple[str, int | None], tuple[dict[str, Any], str]] = {}
    logs = tmp_path_factory.mktemp("digest_logs")

    def run(backend: str, workers: int | None = None) -> tuple[dict[str, Any], str]:
        key = (backend, workers)
        if key not in done:
            log = logs / f"{backend}-{workers}.txt"
            args = ["run", str(job / "config.yaml"), "--steps", str(STEPS), "--digest",
                    "--json", "--no-progress", "--backend", backend, "--digest-log", str(log)]
            if backend == "ray":
                args += ["--address", ray_cluster, "--workers", str(workers)]
            s = summary(run_cli(args, cache_dir=cache_dir))
            done[key] = (s, log.read_text(encoding="utf-8"))
        return done[key]

    return run


VARIANTS = [("ray", 1), ("ray", 2), ("ray", 3), ("local", None)]


# -- the summary and the digest -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("backend,workers", [("ray", 2), ("local", None)])
def test_run_prints_a_json_summary_with_sane_values(cli_run, backend, workers):
    s, _ = cli_run(backend, workers)
    for key in ("steps", "tokens", "tokens_per_s", "startup_s", "padding_rows",
                "stall_fraction", "workers", "backend", "digest"):
        assert key in s, f"summary lacks {key!r}: {sorted(s)}"
    assert s["steps"] == STEPS
    assert 0 < s["tokens"] <= STEPS * CONFIG["global_batch_size"] * CONFIG["seq_len"]
    assert s["tokens_per_s"] > 0
    assert math.isfinite(s["startup_s"]) and s["startup_s"] >= 0
    assert 0 <= s["padding_rows"] <= STEPS * CONFIG["global_batch_size"]
    assert 0 <= s["stall_fraction"] <= 1
    assert s["backend"] == backend
    assert s["workers"] == (workers if backend == "ray" else 0)
    assert re.fullmatch(r"[0-9a-f]{64}", s["digest"]), s["digest"]
    # The runtime knobs as the run resolved them: chunk_rows as given, the others automatic.
    knobs = s["runtime"]
    assert (knobs["chunk_rows"], knobs["streams_per_call"], knobs["prefetch"]) == (
        3, 8 // (workers or 2), 2)
    assert sorted(knobs["reasons"]) == ["prefetch", "streams_per_call"]
    assert knobs["reasons"]["prefetch"].startswith("auto: ")
    # Two rates, named for what they mean; no stall without a training step (the loop does
    # nothing but wait for batches).
    lines = "\n".join(summary_lines(s))
    assert s["step_time_s"] == 0 and "training_stall_fraction" not in s
    assert "stall" not in lines, lines
    assert s["run_tokens_per_s"] > 0 and s["run_s"] >= s["startup_s"]
    assert "run rate " in lines and "what this run got" in lines
    assert "feed rate " in lines
    if s["feed_tokens_per_s"] is not None:  # else the line says why (too few steps, say)
        assert s["feed_tokens_per_s"] > 0 and s["feed_rate_from_step"] >= 1
        assert "how fast the feed can go" in lines


@pytest.mark.slow
@pytest.mark.ray
def test_digest_is_the_same_for_any_worker_count_and_the_local_backend(cli_run, in_process):
    digests = {f"{b}-{w}": cli_run(b, w)[0]["digest"] for b, w in VARIANTS}
    assert len(set(digests.values())) == 1, digests
    # ... and it is the digest of the first STEPS batches of the feed run in this process.
    assert set(digests.values()) == {in_process["digest_first"]}


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("backend,workers", [("ray", 3), ("local", None)])
def test_digest_log_has_one_line_per_step_equal_to_in_process_digests(cli_run, in_process,
                                                                      backend, workers):
    _, log = cli_run(backend, workers)
    lines = log.splitlines()
    assert len(lines) == STEPS, log
    for i, line in enumerate(lines):
        m = re.fullmatch(r"(\d+) ([0-9a-f]{64})", line)
        assert m, f"line {i + 1} is not 'STEP SHA256': {line!r}"
        assert int(m.group(1)) == i + 1
        assert m.group(2) == in_process["step_digests"][i], f"step {i + 1}"


@pytest.mark.slow
def test_more_workers_than_cpus_get_a_local_cluster_with_a_cpu_each(job, cache_dir, in_process):
    cpus = os.cpu_count() or 1
    workers = cpus + 1
    if workers > CONFIG["num_streams"]:
        pytest.skip(f"{cpus} CPUs: one worker more than that exceeds the job's streams")
    # No --address: the command starts its own cluster. Before, it had one CPU per core, so
    # the last worker never started and the run waited for it until the 300 s timeout.
    # --no-warm-start: the workers make every row, so each must have made some.
    proc = run_cli(["run", str(job / "config.yaml"), "--steps", str(STEPS), "--digest",
                    "--json", "--no-progress", "--workers", str(workers), "--no-warm-start"],
                   cache_dir=cache_dir)
    s = summary(proc)
    assert s["workers"] == workers
    assert len(s["rows_per_s_by_worker"]) == workers, "every worker should have made rows"
    assert s["digest"] == in_process["digest_first"]
    # A log line, with the time it was written.
    line = (rf"^\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d WARNING ingest: {workers} workers on {cpus} "
            rf"CPUs: the local Ray cluster gets {workers} ")
    assert re.search(line, proc.stderr, re.M), proc.stderr[-3000:]


@pytest.mark.slow
def test_run_without_steps_feeds_to_the_end_of_the_data(job, cache_dir, in_process):
    s = summary(run_cli(["run", str(job / "config.yaml"), "--digest", "--json", "--no-progress",
                         "--backend", "local"], cache_dir=cache_dir))
    assert s["steps"] == len(in_process["step_digests"])
    assert s["digest"] == in_process["digest_all"]
    assert s["padding_rows"] == in_process["stats"]["padding_rows"] > 0
    assert s["tokens"] == in_process["stats"]["tokens"]


def test_a_run_that_saves_no_checkpoint_does_not_import_orbax(job, cache_dir):
    # orbax takes about 0.7 s to import: a run without --checkpoint-dir must not wait for it
    # before its first batch.
    module, function = entry_point()
    report = "import atexit, sys; atexit.register(lambda: print('orbax imported:', " \
             "'orbax.checkpoint' in sys.modules, file=sys.stderr))"
    cmd = [sys.executable, "-c", f"{report}; from {module} import {function}; "
           f"sys.exit({function}())", "run", str(job / "config.yaml"), "--json", "--no-progress",
           "--backend", "local", "--steps", "2"]
    proc = subprocess.run(cmd, env=cli_env(cache_dir), capture_output=True, text=True,
                          timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert summary(proc)["steps"] == 2
    assert "orbax imported: False" in proc.stderr, proc.stderr[-2000:]


# -- errors -------------------------------------------------------------------------------


@pytest.mark.slow
def test_bad_config_prints_every_problem_and_exits_non_zero(tmp_path, job, cache_dir):
    bad = dict(CONFIG, sources=[{"paths": [str(job / "corpus")]}], chunk_rows=0,
               packing="zigzag", global_batch_size=12, num_streams=8, colour="blue")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad), encoding="utf-8")
    proc = run_cli(["run", str(path), "--json", "--no-progress", "--backend", "local"],
                   cache_dir=cache_dir)
    assert proc.returncode != 0, proc.stdout
    err = proc.stderr
    for needle in ("chunk_rows=0", "packing='zigzag'", "'colour'",
                   "global_batch_size=12 is not divisible by num_streams=8",
                   "[1, 2, 3, 4, 6, 12]"):
        assert needle in err, f"{needle!r} missing from stderr:\n{err[-3000:]}"
    assert str(path) in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("what", ["config file", "source path"])
def test_missing_file_exits_non_zero_naming_the_path(tmp_path, cache_dir, what):
    missing = tmp_path / "nowhere" / "data.parquet"
    if what == "config file":
        target = tmp_path / "no-such-config.yaml"
        config = target
    else:
        target = missing
        config = tmp_path / "config.yaml"
        config.write_text(yaml.safe_dump(dict(CONFIG, sources=[{"paths": [str(missing)]}])),
                          encoding="utf-8")
    proc = run_cli(["run", str(config), "--json", "--no-progress", "--backend", "local"],
                   cache_dir=cache_dir)
    assert proc.returncode == 1, proc.stdout
    assert str(target) in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # With --json the last line of stdout is the error, not a summary.
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["exit_status"] == 1 and str(target) in last["error"] and "steps" not in last


@pytest.mark.slow
def test_batch_not_divisible_by_the_local_devices_is_refused(tmp_path, job, cache_dir):
    path = tmp_path / "b12.yaml"
    path.write_text(yaml.safe_dump(dict(CONFIG, sources=[{"paths": [str(job / "corpus")]}],
                                        global_batch_size=12, num_streams=4)),
                    encoding="utf-8")
    proc = run_cli(["run", str(path), "--json", "--no-progress", "--backend", "local"],
                   cache_dir=cache_dir)
    assert proc.returncode != 0
    assert "global_batch_size=12" in proc.stderr, proc.stderr[-3000:]
    assert "8" in proc.stderr


@pytest.mark.parametrize("argv,needle", [
    (["run", "--steps", "0"], "--steps=0"),
    (["run", "--workers", "-1"], "--workers=-1"),
    (["run", "--checkpoint-every", "2"], "--checkpoint-dir"),
    (["run", "--resume"], "--checkpoint-dir"),
])
def test_invalid_flags_are_refused_before_anything_runs(capsys, argv, needle):
    assert call_main(argv) == 2
    assert needle in capsys.readouterr().err


# -- the demo -----------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_runs_without_a_config(tmp_path):
    cache = tmp_path / "cache"
    s = summary(run_cli(["run", "--steps", "3", "--json", "--no-progress", "--backend", "local"],
                        cache_dir=cache, cwd=tmp_path))
    assert s["steps"] == 3
    assert s["backend"] == "local"
    assert s["tokens"] > 0
    # The demo corpus was written under INGEST_CACHE_DIR, and finished.
    written = list(cache.glob("demo-stdlib-*/_SUCCESS"))
    assert len(written) == 1, sorted(p.name for p in cache.iterdir())
    assert list(written[0].parent.glob("part-*.parquet"))


def _endless_config(job: Path, tmp_path: Path) -> Path:
    """The job's config with endless epochs, written under ``tmp_path``."""
    config = tmp_path / "endless.yaml"
    config.write_text(yaml.safe_dump(dict(CONFIG, num_epochs=None,
                                          sources=[{"paths": [str(job / "corpus")]}])))
    return config


@pytest.mark.slow
@pytest.mark.ray
def test_the_first_batches_come_while_ray_starts_and_the_workers_take_over(job, tmp_path,
                                                                           ray_cluster):
    # The run starts its own local cluster (seconds); 400 steps of 0.04 s outlast that. The
    # host's chunks double up to 128k tokens, and it makes one ahead: rows of 1024 tokens cap
    # them at 64 steps, so that it is not the host alone that reaches step 400. Documents of
    # 200 - 400 words keep the epochs few.
    corpus = tmp_path / "long"
    corpus.mkdir()
    for i in range(4):
        pq.write_table(pa.table({"text": helpers.make_texts(60, 40 + i, min_words=200,
                                                               max_words=400)}),
                       str(corpus / f"part-{i:05d}.parquet"), row_group_size=20)
    config = tmp_path / "long.yaml"
    config.write_text(yaml.safe_dump(dict(CONFIG, num_epochs=None, seq_len=1024,
                                          sources=[{"paths": [str(corpus)]}])))
    steps = 400
    s = summary(run_cli(["run", str(config), "--steps", str(steps), "--digest", "--json",
                         "--no-progress", "--step-time", "0.04", "--workers", "2"],
                        cache_dir=tmp_path, script="ingest-dev"))
    assert s["warm_start_rows"] > 0, "the first rows should come from the command's process"
    assert len(s["rows_per_s_by_worker"]) == 2, "both workers should have taken over"
    assert s["digest"] == _local_digest(config, steps)


@pytest.mark.slow
@pytest.mark.ray
def test_a_run_that_ends_while_its_ray_starts_leaves_at_once_and_its_cluster_is_stopped(
        job, tmp_path, monkeypatch, request):
    # Two steps of a small corpus come long before a local cluster is up (seconds here).
    ray_root = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths
    request.addfinalizer(lambda: shutil.rmtree(ray_root, ignore_errors=True))
    monkeypatch.setenv("RAY_TMPDIR", str(ray_root))
    config = job / "config.yaml"
    proc = run_cli(["run", str(config), "--steps", "2", "--digest", "--json", "--no-progress",
                    "--workers", "2"], cache_dir=tmp_path)
    s = summary(proc)
    if s["ray_up"]:
        pytest.skip("Ray was up before the second batch on this machine: nothing to check")
    assert s["digest"] == _local_digest(config, 2)
    assert s["warm_start_rows"] > 0 and not s.get("rows_per_s_by_worker"), s
    assert "the run ended before Ray was up" in proc.stderr
    # The cluster's folder and processes go with the command (its reaper stops them).
    deadline = time.monotonic() + 60
    while True:
        left = [p.name for p in ray_root.glob("ingest-ray-*")]
        procs = [p.pid for p in psutil.process_iter(["cmdline"])
                 if any(str(ray_root) in a for a in (p.info["cmdline"] or []))]
        if not left and not procs:
            break
        assert time.monotonic() < deadline, f"left after 60 s: folders {left}, processes {procs}"
        time.sleep(0.5)


def _local_digest(config: Path, steps: int) -> str:
    """The digest ``ingest run --digest`` prints for ``steps`` steps of ``config``, made in
    this process on the local backend (the same batches as Ray's, on 8 devices)."""
    sharding = batch_sharding(jax.make_mesh((8,), ("data",)), "data")
    expected = BatchDigest()
    with HostFeed(load_config(str(config)), sharding=sharding, backend="local") as feed:
        for _, batch in zip(range(steps), feed, strict=False):
            expected.update({k: np.asarray(v) for k, v in batch.items()})
    return expected.hexdigest()


@pytest.mark.slow
@pytest.mark.ray
def test_kill_worker_every_keeps_the_digest_and_json_stays_the_last_line(job, tmp_path,
                                                                          ray_cluster):
    # 200 steps of endless epochs and a simulated 0.03 s training step: 6 s of steps at
    # least, so a kill every 3 s lands in them (each replacement adds seconds).
    # The run starts its own local cluster (no --address): kills hit this run's workers only.
    # --no-warm-start: the workers run from the first step, so the kills land.
    # The unbroken run's digest is made in this process (the local backend's batches are
    # Ray's, bit for bit).
    config = _endless_config(job, tmp_path)
    killed = summary(run_cli(["run", str(config), "--steps", "200", "--digest", "--json",
                              "--no-progress", "--step-time", "0.03", "--workers", "2",
                              "--no-warm-start", "--kill-worker-every", "3"],
                             cache_dir=tmp_path, script="ingest-dev"))
    assert killed["steps"] == 200
    assert killed["workers_killed"] >= 1
    assert killed["restarts"] >= 1
    assert killed["digest"] == _local_digest(config, 200)


def test_kill_worker_every_needs_the_ray_backend(tmp_path):
    assert call_main(["run", "--backend", "local", "--kill-worker-every", "1"],
                     script="ingest-dev") == 2


# -- the command line: --version, --set, development flags ----------------------------------


def test_version_prints_the_installed_version(capsys):
    from importlib.metadata import version

    assert call_main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"ingest {version('ingest')}"


@pytest.mark.parametrize("flag", [["--step-time", "0.1"], ["--kill-worker-every", "1"],
                                  ["--hosts", "2"], ["--devices-per-host", "2"]])
def test_development_flags_are_ingest_devs_only(capsys, flag):
    assert call_main(["run", *flag]) == 2
    assert "`ingest-dev run ...`" in capsys.readouterr().err


@pytest.mark.slow
def test_set_overrides_config_fields_as_the_yaml_would(job, cache_dir, tmp_path):
    overridden = tmp_path / "overridden.yaml"
    overridden.write_text(yaml.safe_dump(dict(CONFIG, seq_len=64, global_batch_size=8,
                                              sources=[{"paths": [str(job / "corpus")]}])))
    s = summary(run_cli(["run", str(job / "config.yaml"), "--set", "seq_len=64", "--set",
                         "global_batch_size=8", "--steps", "3", "--digest", "--json",
                         "--no-progress", "--backend", "local"], cache_dir=cache_dir))
    assert s["digest"] == _local_digest(overridden, 3)
    assert s["digest"] != _local_digest(job / "config.yaml", 3)


@pytest.mark.parametrize("item,needle", [
    ("seq_len=abc", "--set seq_len=abc: seq_len='abc' must be a positive integer"),
    ("colour=blue", "--set colour=blue: unknown field 'colour'"),
    ("global_batch_size=12",
     "--set global_batch_size=12: global_batch_size=12 is not divisible by num_streams=8"),
    ("seq_len=[1", "--set seq_len=[1: the value is not valid YAML"),
])
def test_a_bad_set_is_one_line_naming_it(job, capsys, item, needle):
    code = call_main(["run", str(job / "config.yaml"), "--set", item, "--json", "--backend",
                      "local", "--no-progress"])
    out = capsys.readouterr()
    errors = [line for line in out.err.splitlines() if line.startswith("ingest: error:")]
    assert len(errors) == 1 and needle in errors[0], out.err
    assert code == (2 if "YAML" in needle else 1)
    last = json.loads(out.out.strip().splitlines()[-1])
    assert last["error"].startswith(f"--set {item}: ") and last["exit_status"] == code


# -- progress in logs, and a quiet Ray ------------------------------------------------------


@pytest.mark.slow
def test_progress_without_a_terminal_is_a_log_line_every_interval(job, tmp_path):
    # 150 steps behind a simulated step of 0.05 s last 7.5 s at least: three intervals of 2 s.
    config = _endless_config(job, tmp_path)
    err = tmp_path / "stderr.txt"
    with open(err, "w") as f:
        proc = subprocess.run(
            ingest_command("ingest-dev") + ["run", str(config), "--steps", "150", "--backend",
                                            "local", "--step-time", "0.05", "--log-every", "2",
                                            "--json"],
            env=cli_env(tmp_path), stdout=subprocess.PIPE, stderr=f, text=True,
            timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    text = err.read_text()
    assert proc.returncode == 0, text[-3000:]
    found = re.findall(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d INFO ingest: progress: step (\d+) of "
                       r"150  tokens ([\d,]+)  [\d.,]+ [kM]? ?tokens/s \(last [\d.]+ s\)  "
                       r"stall [\d.]+%  ETA \d+", text, re.M)
    steps = [int(s) for s, _ in found]
    tokens = [int(t.replace(",", "")) for _, t in found]
    assert len(steps) >= 3, text[-3000:]
    assert steps == sorted(set(steps)) and tokens == sorted(set(tokens)), found


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("warm_start", [True, False])
def test_a_successful_ray_run_prints_no_warning_or_error_of_rays(job, tmp_path, warm_start):
    env = cli_env(tmp_path)
    env.pop("RAY_AUTH_MODE")  # Ray's own default: token authentication
    env["HOME"] = str(tmp_path)  # where Ray keeps the token it makes (~/.ray)
    proc = run_cli(["run", str(job / "config.yaml"), "--steps", "2", "--json", "--no-progress",
                    "--workers", "2", *([] if warm_start else ["--no-warm-start"])],
                   cache_dir=tmp_path, env=env)
    assert summary(proc)["steps"] == 2
    # Ray's log lines: "DATE TIME,ms\tLEVEL file.py:LINE -- message".
    noise = re.findall(r"^.*\b(?:WARNING|ERROR)\b \S+\.py:\d+ -- .*$", proc.stderr, re.M)
    assert not noise, proc.stderr[-3000:]
