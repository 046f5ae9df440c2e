"""Many JAX hosts: real ``jax.distributed`` processes on 127.0.0.1, 2 processes x 4 CPU devices,
compared with this process's 8 devices.

Each host feeds the rows on its own devices; the global batches must be those of one process,
step for step, on a 1-D and a 2-D mesh; at the end of finite data, a host whose streams ran out
pads until the other's do too, and both stop after the same step. A mesh on which a stream
would straddle two hosts is refused at start, and a host whose peer was SIGKILLed fails within
seconds instead of waiting. ``ingest-dev run --hosts 2`` prints one summary whose digest is the
one-process digest.

Run as a script (``python tests/test_multihost.py child MODE ...``) this module is one JAX
process of a test. Every wait on a subprocess has a deadline: a hang fails the test with what
the processes printed.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import yaml
from helpers import free_port, make_config, write_parquet_corpus

from ingest import FIELDS, step_digest
from jax_side import HostFeed, batch_sharding
from jax_side.multihost import EndAgreement, combine_stats

ROOT = Path(__file__).resolve().parents[1]
CHILD_TIMEOUT_S = 180  # a healthy 2-process run here takes 5-15 s on 2 shared CPUs
PEER_DEATH_DEADLINE_S = 60  # a host whose peer died must have failed within this
MAX_STEPS = 200  # far above any run here: a feed that never ends fails instead of hanging
HOSTS, DEVICES_PER_HOST = 2, 4

# B=8 rows over 8 devices, S=4 streams of k=2 rows: host 0 holds rows 0-3 (streams 0, 1), host
# 1 rows 4-7 (streams 2, 3). chunk_rows=3 keeps the rows in hand (the agreement's lookahead)
# short, so the hosts compare claims several times per run.
FEED = dict(seq_len=32, global_batch_size=8, num_streams=4, unit_rows=5, chunk_rows=3, workers=1,
            prefetch=2)
# Corpora (3 files x 30 documents, about 10 steps) whose streams end unevenly: with seed 5
# host 1's streams run out two steps before host 0's, with seed 3 host 0's one step before.
CORPUS_SEEDS = {"host_1_ends_first": 5, "host_0_ends_first": 3}
MESHES = {"1d": ((8,), ("data",)), "2d": ((4, 2), ("data", "model"))}

SEG = FIELDS.index("inputs_segmentation")


# -- helpers -----------------------------------------------------------------------------------


def make_corpus(directory: Path, seed: int) -> Path:
    write_parquet_corpus(directory, n_files=3, docs_per_file=30, row_group_size=10, seed=seed)
    return directory


def feed_config(corpus: Path, seed: int, **overrides):
    return make_config([corpus], **dict(FEED, seed=seed, **overrides))


def mesh_sharding(mesh: str):
    shape, axes = MESHES[mesh]
    return batch_sharding(jax.make_mesh(shape, axes), "data")


def padding_rows(seg: np.ndarray) -> list[int]:
    """Indices of the rows of ``seg`` (``[rows, seq_len]``) that are all padding."""
    return [int(r) for r in np.flatnonzero(~seg.any(axis=1))]


def child_env() -> dict[str, str]:
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES_PER_HOST}",
                JAX_PLATFORMS="cpu",
                PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))


def start_children(mode: str, spec: dict[str, Any], tmp_path: Path) -> list[subprocess.Popen]:
    """``HOSTS`` processes of this module in ``mode``, joined through one coordinator port.
    Process i writes ``out{i}.json`` and its stderr to ``err{i}.txt`` (a file, so that a
    chatty process never blocks on a full pipe); stdout is a pipe in ``steps`` mode."""
    port = str(free_port())
    procs = []
    for i in range(HOSTS):
        with open(tmp_path / f"err{i}.txt", "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "child", mode, str(i), port, json.dumps(spec),
                 str(tmp_path / f"out{i}.json")], cwd=ROOT, env=child_env(), stderr=err,
                stdout=subprocess.PIPE if mode == "steps" else subprocess.DEVNULL, text=True))
    return procs


def stderr_of(tmp_path: Path, i: int) -> str:
    return (tmp_path / f"err{i}.txt").read_text()


def finish(procs: list[subprocess.Popen], tmp_path: Path, timeout_s: float) -> list[int]:
    """Waits for every process (one shared deadline) and returns their exit statuses; kills
    what is left past the deadline and fails with what every process wrote to stderr."""
    deadline = time.monotonic() + timeout_s
    late = []
    for i, p in enumerate(procs):
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            late.append(i)
    assert not late, (f"process(es) {late} still running after {timeout_s:.0f} s:\n"
                      + "\n".join(f"--- process {i}:\n{stderr_of(tmp_path, i)[-3000:]}"
                                  for i in range(len(procs))))
    return [p.returncode for p in procs]


# -- the one-process reference -----------------------------------------------------------------


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    return {name: make_corpus(tmp_path_factory.mktemp(name), seed)
            for name, seed in CORPUS_SEEDS.items()}


def one_process_run(corpus: Path, seed: int, mesh: str) -> dict[str, Any]:
    """Per-step digests and padding rows of the whole run on this process's 8 devices."""
    digests, padding = [], []
    with HostFeed(feed_config(corpus, seed), sharding=mesh_sharding(mesh),
                  backend="local") as feed:
        for batch in itertools.islice(feed, MAX_STEPS):
            digests.append(step_digest({k: np.asarray(v) for k, v in batch.items()}))
            padding.append(padding_rows(np.asarray(batch["inputs_segmentation"])))
        stats = feed.stats()
    assert 5 <= len(digests) < MAX_STEPS
    return {"digests": digests, "padding": padding, "padding_rows": stats["padding_rows"]}


# -- global batches: 2 processes x 4 devices == 1 process x 8 devices ---------------------------


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh, backend, corpus", [
    ("1d", "ray", "host_1_ends_first"),
    ("2d", "local", "host_0_ends_first"),
])
def test_two_hosts_deliver_the_one_process_batches_and_end_at_the_same_step(
        ray_cluster, corpora, tmp_path, mesh, backend, corpus):
    seed = CORPUS_SEEDS[corpus]
    want = one_process_run(corpora[corpus], seed, mesh)
    half = FEED["global_batch_size"] // HOSTS
    # The corpus really makes one host pad while the other still has rows at the end.
    early = 1 if corpus == "host_1_ends_first" else 0
    block = range(early * half, (early + 1) * half)
    uneven = [step for step, pad in enumerate(want["padding"], 1)
              if set(block) <= set(pad) and len(pad) < FEED["global_batch_size"]]
    assert uneven, f"host {early}'s streams never end before the other host's: {want['padding']}"

    spec = dict(corpus=str(corpora[corpus]), seed=seed, mesh=mesh, backend=backend,
                address=ray_cluster)
    codes = finish(start_children("feed", spec, tmp_path), tmp_path, CHILD_TIMEOUT_S)
    for i, code in enumerate(codes):
        assert code == 0, f"process {i} failed:\n{stderr_of(tmp_path, i)[-4000:]}"
    outs = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(HOSTS)]

    assert [o["streams"] for o in outs] == [[0, 1], [2, 3]]
    for i, o in enumerate(outs):
        assert len(o["digests"]) == len(want["digests"]), (
            f"process {i} delivered {len(o['digests'])} steps, one process "
            f"{len(want['digests'])}")
        for step, (got, ref) in enumerate(zip(o["digests"], want["digests"], strict=True), 1):
            assert got == ref, f"process {i}: global batch of step {step} differs"
        # Its own rows are padded exactly where the one-process batches are.
        mine = range(i * half, (i + 1) * half)
        assert o["local_padding"] == [[r - i * half for r in pad if r in mine]
                                      for pad in want["padding"]]
        assert o["backend"] == backend and o["workers"] == (1 if backend == "ray" else 0)
        # Claims cover several steps: fewer allgathers than steps, but at least the last one.
        assert 1 <= o["syncs"] < len(want["digests"]), o["syncs"]
    assert outs[early]["local_padding"][uneven[-1] - 1] == list(range(half))
    assert sum(o["padding_rows"] for o in outs) == want["padding_rows"]


def local_padding_rows(seg: jax.Array) -> list[int]:
    """The all-padding rows of this process's own block of a global ``[B, L]`` array, counted
    from the block's first row (read from its addressable shards, not from a gather)."""
    rows: dict[int, bool] = {}
    for shard in seg.addressable_shards:
        first = shard.index[0].start or 0
        data = np.asarray(shard.data)
        for r in range(data.shape[0]):
            rows[first + r] = rows.get(first + r, False) or bool(data[r].any())
    start = min(rows)
    return [r - start for r in sorted(rows) if not rows[r]]


def _child_feed(spec: dict[str, Any], out: Path) -> None:
    from jax.experimental import multihost_utils

    if spec["backend"] == "ray":
        import ray

        ray.init(address=spec["address"], log_to_driver=False)
    config = feed_config(Path(spec["corpus"]), spec["seed"])
    digests, local_padding = [], []
    with HostFeed(config, sharding=mesh_sharding(spec["mesh"]), backend=spec["backend"]) as feed:
        for batch in itertools.islice(feed, MAX_STEPS):
            digests.append(step_digest(multihost_utils.process_allgather(batch, tiled=True)))
            local_padding.append(local_padding_rows(batch["inputs_segmentation"]))
        stats = feed.stats()
        syncs = feed._end.syncs  # the agreement's allgathers so far (no public counter)
    out.write_text(json.dumps({"streams": list(feed.streams), "digests": digests,
                               "local_padding": local_padding, "syncs": syncs,
                               "padding_rows": stats["padding_rows"],
                               "backend": stats["backend"], "workers": stats["workers"]}))


# -- a stream that would straddle two hosts is refused at start --------------------------------


def write_config(directory: Path, corpus: Path, seed: int, **overrides) -> Path:
    path = directory / "config.yaml"
    fields = dict(FEED, seed=seed, num_epochs=1, tokenizer="gpt2", **overrides)
    path.write_text(yaml.safe_dump(dict(sources=[{"paths": [str(corpus)]}], **fields)))
    return path


def run_cli(args: list[str], timeout_s: float = CHILD_TIMEOUT_S) -> subprocess.CompletedProcess:
    # --hosts is a development flag: ingest-dev's (jax_side.dev).
    cmd = [sys.executable, "-m", "jax_side.dev" if "--hosts" in args else "jax_side.run", *args]
    try:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{cmd} did not finish within {timeout_s} s; stderr:\n"
                             f"{(e.stderr or b'')[-3000:]}") from None


@pytest.mark.slow
@pytest.mark.multiprocess
def test_mesh_on_which_a_stream_straddles_two_hosts_is_refused_at_start(corpora, tmp_path):
    # num_streams=1: the one stream fills all 8 rows, but each host holds 4 of them.
    config = write_config(tmp_path, corpora["host_1_ends_first"], 5, num_streams=1)
    result = run_cli(["run", str(config), "--hosts", "2", "--devices-per-host", "4",
                      "--backend", "local", "--json", "--no-progress"])
    assert result.returncode == 1, result.stderr[-3000:]
    # No summary (nothing was fed): the --json line is host 0's error.
    out = [json.loads(line) for line in result.stdout.strip().splitlines()]
    assert len(out) == 1 and "steps" not in out[0], result.stdout
    assert out[0]["exit_status"] == 1 and "would straddle two hosts" in out[0]["error"]
    for host, rows in ((0, "[0, 4)"), (1, "[4, 8)")):
        assert (f"ingest: error: host {host} of 2: with num_streams=1, each stream fills 8 "
                f"consecutive rows, but this process ({host} of 2) holds rows {rows}"
                in result.stderr), result.stderr[-3000:]
    assert ("on mesh {'data': 8} with rows split over 'data': a stream would straddle two hosts"
            in result.stderr)
    assert "e.g. num_streams=2" in result.stderr and "multiple of 8 rows" in result.stderr


# -- a peer that dies: the survivor fails within seconds, never hangs --------------------------


def lines_of(stream) -> queue.Queue:
    """A queue that receives every line ``stream`` yields, then None at its end."""
    q: queue.Queue = queue.Queue()

    def pump():
        for line in stream:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def wait_for_line(q: queue.Queue, prefix: str, timeout_s: float, procs: list[subprocess.Popen],
                  tmp_path: Path, what: str) -> None:
    """Waits until ``q`` yields a line starting with ``prefix``; on failure kills ``procs`` and
    fails with what they wrote to stderr (``err{i}.txt``)."""
    deadline = time.monotonic() + timeout_s
    seen = []
    while True:
        try:
            line = q.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            line, problem = None, f"printed no line starting {prefix!r} within {timeout_s} s"
        else:
            problem = f"ended before printing {prefix!r}"
        if line is None:
            stop_all(procs)
            errors = "\n".join(f"--- process {i}:\n{stderr_of(tmp_path, i)[-3000:]}"
                               for i in range(len(procs)))
            raise AssertionError(f"{what} {problem}; it printed {seen[-5:]}\n{errors}")
        seen.append(line)
        if line.startswith(prefix):
            return


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        if p.stdout is not None:
            p.stdout.close()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("victim", [1, 0])
def test_sigkilled_peer_makes_the_feed_fail_instead_of_waiting(corpora, tmp_path, victim):
    spec = dict(corpus=str(corpora["host_1_ends_first"]), seed=5, step_time=0.5)
    procs = start_children("steps", spec, tmp_path)
    survivor = procs[1 - victim]
    try:
        wait_for_line(lines_of(procs[victim].stdout), "step 2", CHILD_TIMEOUT_S, procs,
                      tmp_path, f"process {victim}")
        procs[victim].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        try:
            survivor.wait(timeout=PEER_DEATH_DEADLINE_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"process {1 - victim} still ran {PEER_DEATH_DEADLINE_S} s after its peer was "
                f"killed:\n{stderr_of(tmp_path, 1 - victim)[-3000:]}") from None
        took = time.monotonic() - killed_at
    finally:
        stop_all(procs)
    err = stderr_of(tmp_path, 1 - victim)
    assert took < PEER_DEATH_DEADLINE_S
    assert survivor.returncode != 0, err[-3000:]
    if victim == 1:
        # Process 0 hosts JAX's coordination service; it outlives process 1 and reports.
        assert survivor.returncode == 3, err[-3000:]
        assert ("PeerError: process 0 of 2 waited for the end-of-data agreement at step" in err
                and "allgather failed" in err and "Restart all 2 processes" in err), err[-3000:]
    else:
        # Process 0 took the coordination service with it: JAX stops process 1 itself, unless
        # the feed's next allgather failed first.
        assert ("PeerError: process 1 of 2 waited for" in err
                or "JAX distributed service detected fatal errors" in err), err[-3000:]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("staller", [1, 0])
def test_a_peer_that_stalls_without_dying_fails_the_agreement_naming_it_and_the_timeout(
        corpora, tmp_path, staller):
    """One process hangs in its training step after step 2 and stays alive (its JAX
    heartbeats go on); the other must fail at its next end-of-data agreement once
    agreement_timeout_s has passed, naming the process that never came and the setting."""
    timeout_s = 5
    spec = dict(corpus=str(corpora["host_1_ends_first"]), seed=5, step_time=0.2,
                agreement_timeout_s=timeout_s, stall=dict(process=staller, after_step=2))
    procs = start_children("steps", spec, tmp_path)
    waiter = procs[1 - staller]
    try:
        wait_for_line(lines_of(procs[staller].stdout), "stalling", CHILD_TIMEOUT_S, procs,
                      tmp_path, f"process {staller}")
        stalled_at = time.monotonic()
        try:
            waiter.wait(timeout=PEER_DEATH_DEADLINE_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"process {1 - staller} still ran {PEER_DEATH_DEADLINE_S} s after its peer "
                f"stalled:\n{stderr_of(tmp_path, 1 - staller)[-3000:]}") from None
        took = time.monotonic() - stalled_at
        # The waiter's message below says the staller was alive when the waiter gave up. Once
        # process 0 has exited, JAX may abort process 1 (SIGABRT): process 0 hosts the
        # coordination service. Any other end of the staller is a failure.
        ended = procs[staller].poll()
        assert ended is None or (staller == 1 and ended == -signal.SIGABRT), (
            f"the stalled process should still be alive, it ended with {ended}")
    finally:
        stop_all(procs)
    err = stderr_of(tmp_path, 1 - staller)
    assert waiter.returncode == 3, err[-3000:]
    assert f"PeerError: process {1 - staller} of 2 waited {timeout_s} s for the end-of-data " \
           f"agreement at step" in err, err[-3000:]
    assert f"process(es) [{staller}] of 2 never arrived: stalled without dying" in err, err[-3000:]
    assert (f"That is the limit agreement_timeout_s={timeout_s}: raise it "
            f"(HostFeed(agreement_timeout_s=...), ingest run --agreement-timeout SECONDS)"
            in err), err[-3000:]
    assert took < PEER_DEATH_DEADLINE_S


def _child_steps(spec: dict[str, Any], out: Path) -> None:
    from jax_side.host_join import leave
    from jax_side.multihost import PeerError

    config = feed_config(Path(spec["corpus"]), spec["seed"])
    stall = spec.get("stall")
    timeouts = ({"agreement_timeout_s": spec["agreement_timeout_s"]}
                if "agreement_timeout_s" in spec else {})
    try:
        with HostFeed(config, sharding=mesh_sharding("1d"), backend="local", **timeouts) as feed:
            for step, _ in enumerate(itertools.islice(feed, MAX_STEPS), 1):
                print(f"step {step}", flush=True)
                if stall and stall == dict(process=jax.process_index(), after_step=step):
                    print("stalling", flush=True)
                    threading.Event().wait(CHILD_TIMEOUT_S)  # a hung step; the process lives
                time.sleep(spec["step_time"])  # a stand-in for the training step
    except PeerError as e:
        print(f"PeerError: {e}", file=sys.stderr, flush=True)
        leave(3)
    out.write_text(json.dumps({"finished": True}))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_cli_host_whose_peer_was_sigkilled_exits_with_an_error(corpora, tmp_path):
    """Each host runs ``ingest run CONFIG --coordinator ... --num-hosts 2 --host-id I``, as on
    a cluster; process 1 is killed mid-run, process 0 must report it and exit."""
    config = write_config(tmp_path, corpora["host_1_ends_first"], 5)
    port = free_port()
    procs = []
    for i in range(HOSTS):
        with open(tmp_path / f"err{i}.txt", "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "jax_side.dev", "run", str(config), "--backend", "local",
                 "--coordinator", f"127.0.0.1:{port}", "--num-hosts", "2", "--host-id", str(i),
                 "--digest-log", "/dev/stdout", "--step-time", "0.5", "--json"],
                cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=err, text=True))
    try:
        # Process 0 logs the digest of every global batch, gathered from both processes.
        lines = lines_of(procs[0].stdout)
        wait_for_line(lines, "2 ", CHILD_TIMEOUT_S, procs, tmp_path, "process 0")
        procs[1].send_signal(signal.SIGKILL)
        try:
            procs[0].wait(timeout=PEER_DEATH_DEADLINE_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"process 0 still ran {PEER_DEATH_DEADLINE_S} s after process "
                                 f"1 was killed:\n{stderr_of(tmp_path, 0)[-3000:]}") from None
        rest = []
        while (line := lines.get(timeout=10)) is not None:  # to the end of process 0's stdout
            rest.append(line)
    finally:
        stop_all(procs)
    err = stderr_of(tmp_path, 0)
    assert procs[0].returncode == 1, err[-3000:]
    assert "ingest: error: host 0 of 2: process 0 of 2 waited for " in err, err[-3000:]
    assert "Another process has probably died or left" in err
    # A failed run prints no summary: its --json line, the last, is the error.
    assert rest and rest[-1].startswith("{"), rest
    assert "steps" not in json.loads(rest[-1]) and "error" in json.loads(rest[-1])


# -- ingest-dev run --hosts 2: one summary, the one-process digest -----------------------------


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.multiprocess
def test_cli_two_local_hosts_print_one_summary_with_the_one_process_digest(
        ray_cluster, corpora, tmp_path):
    config = write_config(tmp_path, corpora["host_1_ends_first"], 5)
    common = ["run", str(config), "--digest", "--json", "--no-progress", "--address",
              ray_cluster]
    one = run_cli(common)  # this process's environment: 8 forced CPU devices
    two = run_cli([*common, "--hosts", "2", "--devices-per-host", "4"])
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    single = json.loads(one.stdout.strip().splitlines()[-1])
    lines = [line for line in two.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, f"expected one summary, got {len(lines)}:\n{two.stdout}"
    multi = json.loads(lines[0])
    assert multi["hosts"] == 2 and multi["streams"] == 4 and multi["workers"] == 2
    assert multi["backend"] == "ray"
    for key in ("digest", "steps", "tokens", "padding_rows", "padding_tokens", "documents"):
        assert multi[key] == single[key], f"{key}: 2 hosts {multi[key]}, 1 host {single[key]}"
    assert two.stderr.count(f"digest {single['digest']}") == 1


@pytest.mark.parametrize("argv, message", [
    (["--hosts", "2", "--host-id", "0"], "--hosts N needs N > 0 and starts its own processes"),
    (["--coordinator", "127.0.0.1:1234"], "--coordinator, --num-hosts and --host-id go together"),
    (["--coordinator", "h:1", "--num-hosts", "2", "--host-id", "2"],
     "--host-id=2 must be in 0..1 for --num-hosts=2"),
    (["--hosts", "2", "--devices-per-host", "0"], "--devices-per-host=0 must be positive"),
])
def test_multihost_flags_are_checked_together(capsys, argv, message):
    from ingest.cli import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["run", *argv], dev=True)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_one_summary_adds_counts_and_keeps_the_worst_times():
    hosts = [dict(steps=9, first_step=0, last_step=9, backend="ray", digest="d", tokens=10,
                  padding_rows=3, stall_fraction=0.1, startup_s=4.0, workers=1,
                  rows_per_s_by_worker={"w0": 1.0}, rows_per_s_by_stream={"0": 1.0},
                  skipped_documents={"empty": {"a": 1}}, skipped_files=["x"]),
             dict(steps=9, first_step=0, last_step=9, backend="ray", digest="d", tokens=5,
                  padding_rows=0, stall_fraction=0.3, startup_s=3.0, workers=1,
                  rows_per_s_by_worker={"w0": 2.0}, rows_per_s_by_stream={"2": 2.0},
                  skipped_documents={"empty": {"a": 2, "b": 1}}, skipped_files=["x", "y"])]
    out = combine_stats(hosts)
    assert (out["tokens"], out["padding_rows"], out["workers"]) == (15, 3, 2)
    assert (out["stall_fraction"], out["startup_s"], out["hosts"]) == (0.3, 4.0, 2)
    assert out["rows_per_s_by_worker"] == {"0/w0": 1.0, "1/w0": 2.0}
    assert out["rows_per_s_by_stream"] == {"0": 1.0, "2": 2.0}
    assert out["skipped_documents"] == {"empty": {"a": 3, "b": 1}}
    assert out["skipped_files"] == ["x", "y"]
    with pytest.raises(RuntimeError, match="the hosts disagree on 'steps'"):
        combine_stats([hosts[0], dict(hosts[1], steps=8)])


def test_one_process_agreement_follows_the_claims():
    # On one process the allgather is this process's own claim.
    end = EndAgreement()
    assert end.continues(1, 3) and end.syncs == 1
    assert end.continues(2, 0) and end.continues(3, 0) and end.syncs == 1  # covered by 3
    assert not end.continues(4, 3) and end.syncs == 2


_SCHEDULER_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                   "SLURM_LOCALID", "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE",
                   "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK", "KUBERNETES_SERVICE_HOST",
                   "JOB_COMPLETION_INDEX", "TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES",
                   "MEGASCALE_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS",
                   "JAX_COORDINATOR_PORT")
JOIN_CHECK_TIMEOUT_S = 120  # a process that fails to join must have exited within this


def slurm_env(process: int, processes: int) -> dict[str, str]:
    """What ``srun`` sets for one task, on this machine."""
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "127.0.0.1",
            "SLURM_NTASKS": str(processes), "SLURM_PROCID": str(process),
            "SLURM_LOCALID": str(process)}


def cluster_env(**extra: str) -> dict[str, str]:
    """``child_env()`` without any launcher's variables, plus ``extra``."""
    env = {k: v for k, v in child_env().items() if k not in _SCHEDULER_VARS}
    env.update(extra)
    return env


@pytest.mark.parametrize("env, found", [
    ({}, []),
    (slurm_env(2, 4), [("SLURM", 4)]),
    (slurm_env(0, 1), [("SLURM", 1)]),
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "2"}, []),  # not inside a SLURM job
    ({"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "3"}, [("Open MPI", 8)]),
    ({"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1:34911"}, [("Open MPI", None)]),
    ({"PMI_SIZE": "2", "PMI_RANK": "0"}, [("MPI (PMI)", 2)]),
    ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, []),  # a plain pod: one process
    ({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "3"},
     [("Kubernetes indexed Job", None)]),
    ({"TPU_WORKER_HOSTNAMES": "t-0,t-1,t-2,t-3"}, [("Cloud TPU", 4)]),
    ({"TPU_WORKER_HOSTNAMES": "localhost"}, [("Cloud TPU", 1)]),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, [("JAX", None)]),
])
def test_cluster_hints_are_the_variables_the_launchers_set(env, found):
    from jax_side.host_join import cluster_hints

    assert [(h.environment, h.processes) for h in cluster_hints(env)] == found


def test_the_kubernetes_hint_names_the_k8s_extra_where_the_client_is_missing():
    import importlib.util

    from jax_side.host_join import cluster_hints

    [hint] = cluster_hints({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "0"})
    missing = importlib.util.find_spec("kubernetes") is None
    assert ("pip install 'ingest[k8s]'" in hint.fix) is missing
    assert "JOB_COMPLETION_INDEX" in hint.fix


@pytest.mark.slow
@pytest.mark.parametrize("env, evidence, fix", [
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1"}, "JAX: JAX_COORDINATOR_ADDRESS=127.0.0.1:1",
     "--coordinator 127.0.0.1:1 --num-hosts N --host-id I"),
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"},
     "Open MPI: OMPI_COMM_WORLD_SIZE=2", "I=$OMPI_COMM_WORLD_RANK"),
    ({"PMI_SIZE": "2", "PMI_RANK": "1"}, "MPI (PMI): PMI_SIZE=2", "I=$PMI_RANK"),
    ({"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "1",
      "JOB_COMPLETION_INDEX": "1"},
     "Kubernetes indexed Job: JOB_COMPLETION_INDEX=1", "I=$JOB_COMPLETION_INDEX"),
], ids=["coordinator-address-alone", "open-mpi-5", "pmi", "kubernetes"])
def test_the_command_fails_where_the_environment_suggests_hosts_jax_cannot_join(
        tmp_path, env, evidence, fix):
    """An environment that shows several processes, where JAX's detection finds none, stops
    the command with one line that names the variables and the fix, instead of a run alone."""
    out = subprocess.run(
        [sys.executable, "-m", "jax_side.run", "run", "--backend", "local", "--steps", "1",
         "--json", "--no-progress"], cwd=ROOT, capture_output=True, text=True,
        timeout=JOIN_CHECK_TIMEOUT_S, env=cluster_env(INGEST_CACHE_DIR=str(tmp_path), **env))
    assert out.returncode == 1, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    # No step ran: the only line on stdout is --json's error line.
    error = json.loads(out.stdout)
    assert error["exit_status"] == 1 and "could not join them" in error["error"], out.stdout
    line = next(x for x in out.stderr.splitlines() if x.startswith("ingest: error:"))
    assert f"the environment suggests several JAX processes ({evidence})" in line, line
    assert "jax.distributed.initialize() could not join them" in line and fix in line, line
    assert "Traceback" not in out.stderr


_JOIN_ALONE = """
import logging, sys
logging.basicConfig(level=logging.INFO)
from jax_side import host_join
host_join.initialize(None, None, None, timeout_s=float(sys.argv[1]))
print("joined")
"""


@pytest.mark.slow
@pytest.mark.parametrize("process", [0, 1])
def test_a_host_whose_peers_never_arrive_fails_with_one_line_after_the_join_timeout(process):
    """SLURM shows 2 tasks, only this one starts: it gives up after the join timeout with one
    line naming the environment and the fix (JAX alone would abort with a native trace)."""
    env = cluster_env(**slurm_env(process, 2), JAX_COORDINATOR_PORT=str(free_port()))
    out = subprocess.run([sys.executable, "-c", _JOIN_ALONE, "2"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=JOIN_CHECK_TIMEOUT_S)
    assert out.returncode == 1, (out.returncode, out.stderr[-3000:])
    assert "joined" not in out.stdout
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ingest: error: the JAX processes (SLURM: SLURM_NTASKS=2) did not "
                           "all arrive within 2 s at jax.distributed.initialize()"), last
    assert "srun" in last and "--coordinator HOST:PORT" in last, last


@pytest.mark.slow
def test_an_environment_of_one_process_runs_alone_without_joining():
    code = _JOIN_ALONE + "import jax; print(jax.process_count(), " \
                         "jax.distributed.is_initialized())\n"
    out = subprocess.run([sys.executable, "-c", code, "2"], cwd=ROOT,
                         env=cluster_env(**slurm_env(0, 1)), capture_output=True, text=True,
                         timeout=JOIN_CHECK_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["joined", "1", "False"]
    assert "the environment shows one process (SLURM: SLURM_NTASKS=1)" in out.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
def test_cli_hosts_join_through_the_cluster_environment_jax_detects(corpora, tmp_path):
    """Two ``ingest run CONFIG`` processes without --coordinator, started as srun starts
    tasks (the coordinator on 127.0.0.1), give the one-process run's batches."""
    config = write_config(tmp_path, corpora["host_1_ends_first"], 5)
    common = ["run", str(config), "--backend", "local", "--digest", "--json", "--no-progress"]
    one = run_cli(common)  # this process's environment: 8 forced CPU devices
    assert one.returncode == 0, one.stderr[-3000:]
    single = json.loads(one.stdout.strip().splitlines()[-1])
    port = free_port()
    procs = []
    for i in range(HOSTS):
        env = cluster_env(**slurm_env(i, HOSTS), JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}")
        with open(tmp_path / f"err{i}.txt", "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "jax_side.run", *common], cwd=ROOT, env=env,
                stdout=subprocess.PIPE, stderr=err, text=True))
    try:
        codes = finish(procs, tmp_path, CHILD_TIMEOUT_S)
        outs = [p.stdout.read() for p in procs]
    finally:
        stop_all(procs)
    assert codes == [0, 0], [stderr_of(tmp_path, i)[-3000:] for i in range(HOSTS)]
    assert ("the environment suggests several processes (SLURM: SLURM_NTASKS=2; JAX: "
            f"JAX_COORDINATOR_ADDRESS=127.0.0.1:{port})") in stderr_of(tmp_path, 1)
    assert "joined as process 1 of 2" in stderr_of(tmp_path, 1)
    lines = [line for out in outs for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1, f"expected one summary, got {outs}"
    multi = json.loads(lines[0])
    assert multi["hosts"] == 2 and multi["streams"] == 4
    for key in ("digest", "steps", "tokens", "padding_rows", "documents"):
        assert multi[key] == single[key], f"{key}: 2 hosts {multi[key]}, 1 host {single[key]}"


# -- one JAX process of a test -----------------------------------------------------------------


def _child(argv: list[str]) -> None:
    mode, pid, port, spec, out = argv
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=HOSTS,
                               process_id=int(pid), initialization_timeout=CHILD_TIMEOUT_S)
    {"feed": _child_feed, "steps": _child_steps}[mode](json.loads(spec), Path(out))


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    _child(sys.argv[2:])
