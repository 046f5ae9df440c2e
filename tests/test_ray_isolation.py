"""`ingest run` beside whatever else runs Ray on the machine, and its exit.

Without ``--address``, each command starts a cluster of its own and never joins another: not
the one a stale ``ray_current_cluster`` file names, not a live ``ray start --head``, not a
second ``ingest run`` starting at the same time. Given an address that is gone, it fails fast.
A SIGKILLed driver leaves none of its processes behind; SIGINT and SIGTERM exit with one line.

Every command here runs as a subprocess with ``RAY_TMPDIR`` set to a short directory of the
test's own, so that Ray's default files (``<RAY_TMPDIR>/ray/ray_current_cluster``) are the
test's and the other clusters on the machine are never touched.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tests.helpers import free_port, make_texts

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 240  # a healthy run takes about 10 s; 2 CPUs may be shared with other tests
EXIT_BOUND_S = 15  # how long a dead driver's processes may linger (Ray's fate sharing: ~1 s)
STEPS = 5

CONFIG = {
    "sources": [{"paths": ["corpus"], "text_column": "text"}],  # relative to the YAML file
    "tokenizer": "gpt2",
    "seq_len": 32,
    "global_batch_size": 16,  # divisible by the 8 devices the command puts on its mesh
    "num_streams": 8,
    "unit_rows": 10,
    "chunk_rows": 3,
    "seed": 5,
    "num_epochs": 1,
    "workers": 2,
    "pin_workers": False,  # other tests' workers run beside these
}


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("isolation_job")
    (root / "corpus").mkdir()
    for i in range(4):
        pq.write_table(pa.table({"text": make_texts(60, seed=70 + i)}),
                       str(root / "corpus" / f"part-{i}.parquet"), row_group_size=20)
    (root / "config.yaml").write_text(yaml.safe_dump(CONFIG), encoding="utf-8")
    return root / "config.yaml"


@pytest.fixture
def ray_tmp():
    """A short ``RAY_TMPDIR`` (Ray's unix socket paths below it are limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="rti", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def env_for(ray_tmp: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update({
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "RAY_AUTH_MODE": "disabled",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_TMPDIR": str(ray_tmp),
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
    })
    env.update(extra)
    return env


def ingest(args: list[str]) -> list[str]:
    # --hosts and --step-time are development flags: ingest-dev's (jax_side.dev).
    dev = "--hosts" in args or "--step-time" in args
    return [sys.executable, "-m", "jax_side.dev" if dev else "jax_side.run", *args]


def run_args(config: Path, backend: str = "ray", *extra: str) -> list[str]:
    return ["run", str(config), "--steps", str(STEPS), "--digest", "--json", "--no-progress",
            "--backend", backend, *extra]


def finish(proc: subprocess.Popen, timeout: float = RUN_TIMEOUT_S) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{proc.args} did not finish within {timeout} s\n{err[-3000:]}")
    return proc.returncode, out, err


def summary(code: int, out: str, err: str) -> dict[str, Any]:
    assert code == 0, f"exit {code}\nstdout:\n{out[-2000:]}\nstderr:\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


def run_ingest(args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    return finish(subprocess.Popen(ingest(args), env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True))


@pytest.fixture(scope="module")
def reference_digest(job, tmp_path_factory) -> str:
    """The digest of the same run on the local backend (no Ray at all)."""
    ray_tmp = tmp_path_factory.mktemp("local_ref")
    return summary(*run_ingest(run_args(job, "local"), env_for(ray_tmp)))["digest"]


def processes_mentioning(directory: str) -> list[psutil.Process]:
    """Live processes with ``directory`` in their command line or a file open below it (Ray's
    agents rewrite their command line, but keep their logs open)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(directory in a for a in p.info["cmdline"] or ()) or any(
                    os.readlink(fd.path).startswith(directory)
                    for fd in os.scandir(f"/proc/{p.pid}/fd")):
                found.append(p)
        except (psutil.Error, OSError):
            pass
    return found


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Waits until every process in ``procs`` has exited; returns those still alive."""
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return _alive(alive)


class Head:
    """``ray start --head`` on 127.0.0.1 with its own ports and temp dir (another user's
    cluster, as far as ingest can tell); stopped by killing the processes under its temp dir
    (`ray stop` would end every Ray cluster on the machine)."""

    def __init__(self, ray_tmp: Path, num_cpus: int = 1, attempts: int = 3):
        self.temp_dir = ray_tmp / "ray"  # Ray's default temp dir under RAY_TMPDIR
        self.env = env_for(ray_tmp)
        last = ""
        # `ray start` gives the raylet a fixed 30 s to register with the GCS; on a loaded 2-CPU
        # machine that can pass, so a failed start is cleaned up and tried again on new ports.
        for _ in range(attempts):
            self.port = free_port()
            out = subprocess.run(self._command(num_cpus), env=self.env, capture_output=True,
                                 text=True, timeout=120)
            if not out.returncode:
                self.address = f"127.0.0.1:{self.port}"
                return
            last = f"{out.stdout[-1500:]}{out.stderr[-1500:]}{self._log_tails()}"
            self.stop()
        pytest.fail(f"`ray start --head` failed {attempts} times; the last:\n{last}")

    def _command(self, num_cpus: int) -> list[str]:
        bin_dir = Path(sys.executable).parent
        return [str(bin_dir / "ray"), "start", "--head", f"--port={self.port}",
                "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}",
                "--include-dashboard=false", f"--temp-dir={self.temp_dir}",
                "--disable-usage-stats",
                f"--dashboard-agent-listen-port={free_port()}",
                f"--dashboard-agent-grpc-port={free_port()}",
                f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
                f"--ray-client-server-port={free_port()}"]

    def _log_tails(self) -> str:
        """The ends of the GCS's and raylet's logs of the latest session, to say why it failed."""
        tails = []
        for name in ("gcs_server.out", "raylet.out"):
            for log in sorted(self.temp_dir.glob(f"session_*/logs/{name}"))[-1:]:
                tails.append(f"\n--- {log.name} ---\n" + log.read_text(errors="replace")[-1500:])
        return "".join(tails)

    def answers(self) -> tuple[int, int]:
        """Runs a task on this cluster from a fresh driver: (its result, the cluster's nodes)."""
        probe = (f"import ray; ray.init(address={self.address!r}, log_to_driver=False); "
                 "print(ray.get(ray.remote(lambda: 7).remote()), len(ray.nodes()))")
        out = subprocess.run([sys.executable, "-c", probe], env=self.env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        result, nodes = out.stdout.split()[-2:]
        return int(result), int(nodes)

    def processes(self) -> list[psutil.Process]:
        return processes_mentioning(str(self.temp_dir))

    def stop(self) -> None:
        procs = self.processes()
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=30)


@pytest.fixture
def head(ray_tmp):
    h = Head(ray_tmp)
    yield h
    h.stop()


def own_temp_dirs(ray_tmp: Path) -> list[Path]:
    return sorted(ray_tmp.glob("ingest-ray-*"))


# -- never joining a cluster it was not given ---------------------------------------------------


@pytest.mark.parametrize("hosts", [[], ["--hosts", "2", "--devices-per-host", "4"]],
                         ids=["one-process", "two-local-hosts"])
def test_a_stale_ray_current_cluster_file_is_ignored(job, ray_tmp, reference_digest, hosts):
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text(dead)
    s = summary(*run_ingest(run_args(job, "ray", *hosts), env_for(ray_tmp)))
    assert s["backend"] == "ray" and s["workers"] == 2 * (1 + bool(hosts))
    assert s["digest"] == reference_digest
    assert (ray_tmp / "ray" / "ray_current_cluster").read_text() == dead  # not ours to change
    assert own_temp_dirs(ray_tmp) == []  # the run's own temp dir is removed at exit


def test_materialize_ignores_a_stale_ray_current_cluster_file(job, ray_tmp, tmp_path):
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}")
    code, out, err = run_ingest(["materialize", str(job), "--out", str(tmp_path / "m"),
                                 "--json", "--no-progress"], env_for(ray_tmp))
    assert summary(code, out, err)["complete"]


def test_a_live_ray_start_head_is_neither_joined_nor_disturbed(job, ray_tmp, head,
                                                               reference_digest):
    assert head.answers() == (7, 1)
    # `ray start` wrote its address where ray.init(address=None) looks first.
    assert (head.temp_dir / "ray_current_cluster").read_text().strip() == head.address
    s = summary(*run_ingest(run_args(job), env_for(ray_tmp)))
    assert s["digest"] == reference_digest
    # The head still runs tasks, and the run added no node to it.
    assert head.answers() == (7, 1)
    assert own_temp_dirs(ray_tmp) == []


def test_two_runs_starting_at_once_each_get_their_own_cluster(job, ray_tmp, reference_digest):
    env = env_for(ray_tmp)
    procs = [subprocess.Popen(ingest(run_args(job)), env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
             for _ in range(2)]
    for p in procs:
        s = summary(*finish(p))
        assert s["digest"] == reference_digest and s["workers"] == 2
    assert own_temp_dirs(ray_tmp) == []


# -- an address that is gone --------------------------------------------------------------------


@pytest.mark.parametrize("via", ["--address", "RAY_ADDRESS"])
def test_joining_a_cluster_that_is_gone_fails_fast_naming_the_address(job, ray_tmp, via):
    dead = f"127.0.0.1:{free_port()}"
    extra = ["--address", dead] if via == "--address" else []
    env = env_for(ray_tmp, **({"RAY_ADDRESS": dead} if via == "RAY_ADDRESS" else {}))
    t0 = time.monotonic()
    code, _, err = run_ingest(run_args(job, "ray", *extra), env)
    took = time.monotonic() - t0
    assert code == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("ingest: error: cannot reach the Ray cluster at " + dead), err[-3000:]
    assert ("$RAY_ADDRESS" if via == "RAY_ADDRESS" else "--address") in last
    assert "ray start --head" in last  # the fix
    assert "Traceback" not in err
    assert took < 60, f"took {took:.0f} s to give up on {dead}"  # ray.init alone retries minutes


# -- a head that listens on 127.0.0.1 only, given by its loopback address ------------------------


def without_loopback_switch(env: dict[str, str]) -> dict[str, str]:
    """``env`` without Ray's loopback switch: Ray then connects to a loopback address through
    the machine's own address, as it does by default."""
    from actors.ray_cluster import LOOPBACK_SWITCH

    return {k: v for k, v in env.items() if k != LOOPBACK_SWITCH}


def own_address_or_skip() -> str:
    """The address Ray gives this machine's node when it may use every interface; skips where
    that is loopback (no route off the machine: Ray stays on 127.0.0.1 anyway)."""
    from actors.ray_cluster import _is_loopback, _own_address

    own = _own_address()
    if own is None or _is_loopback(own):
        pytest.skip("this machine has no address besides loopback for Ray to switch to")
    return own


@pytest.fixture
def loopback_head(ray_tmp):
    own_address_or_skip()
    h = Head(ray_tmp, num_cpus=2)  # the loopback switch is on: it listens on 127.0.0.1 only
    yield h
    h.stop()


def test_a_loopback_only_head_given_by_its_loopback_address_is_joined(job, ray_tmp,
                                                                      loopback_head,
                                                                      reference_digest):
    """Without the loopback switch in its environment, Ray would connect to the machine's own
    address, where the head does not listen, and retry for minutes."""
    env = without_loopback_switch(env_for(ray_tmp))
    s = summary(*run_ingest(run_args(job, "ray", "--address", loopback_head.address), env))
    assert s["digest"] == reference_digest and s["workers"] == 2
    assert loopback_head.answers() == (7, 1)  # joined, no node of its own added
    assert own_temp_dirs(ray_tmp) == []


_START_AFTER_IMPORT = """
import sys
import ray  # imported before ingest could keep Ray on 127.0.0.1
from actors.ray_cluster import ClusterUnreachableError, start_ray
try:
    start_ray(sys.argv[1])
except ClusterUnreachableError as e:
    print(e, file=sys.stderr)
    sys.exit(1)
print("joined")
"""


def test_joining_a_loopback_only_head_after_importing_ray_fails_in_seconds(ray_tmp,
                                                                           loopback_head):
    """From Python, with Ray imported before: one line naming the address and the fix,
    instead of Ray's minutes of retries at the machine's own address."""
    own = own_address_or_skip()
    port = loopback_head.address.rsplit(":", 1)[1]
    out = subprocess.run([sys.executable, "-c", _START_AFTER_IMPORT, loopback_head.address],
                         env=without_loopback_switch(env_for(ray_tmp)), cwd=ROOT,
                         capture_output=True, text=True, timeout=60)  # Ray alone: minutes
    assert out.returncode == 1, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"the Ray cluster at {loopback_head.address} (--address="
                           f"{loopback_head.address}) answers on 127.0.0.1 only"), last
    assert f"through this machine's address {own}:{port}, where nothing answers" in last
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" in last  # the fix
    assert f"ray start --head --node-ip-address={own}" in last  # the other fix


def alone_on_the_machine(command: list[str]) -> list[str]:
    """``command`` in a PID namespace of its own, where no other program's Ray runs (Ray's
    ``auto`` joins any running cluster it finds before it reads ``ray_current_cluster``):
    the tests' own cluster may be up. Skips where namespaces cannot be made."""
    unshare = shutil.which("unshare")
    probe = [unshare, "--pid", "--fork", "--mount-proc", "true"] if unshare else None
    if probe is None or subprocess.run(probe, capture_output=True, timeout=30).returncode:
        from ray._private.services import find_gcs_addresses

        if find_gcs_addresses():
            pytest.skip("a Ray cluster runs on this machine and `unshare --pid` is not "
                        "available to hide it")
        return command
    return [unshare, "--pid", "--fork", "--mount-proc", *command]


def test_address_auto_with_a_stale_file_names_the_file(job, ray_tmp):
    dead = f"127.0.0.1:{free_port()}"
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text(dead)
    command = alone_on_the_machine(ingest(run_args(job, "ray", "--address", "auto")))
    code, _, err = finish(subprocess.Popen(command, env=env_for(ray_tmp), cwd=ROOT,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           stdin=subprocess.DEVNULL, text=True))
    assert code == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert dead in last and "ray_current_cluster" in last and "ray stop" in last, last


# -- exits ---------------------------------------------------------------------------------------


def start_slow_run(job: Path, env: dict[str, str], log: Path, *extra: str) -> subprocess.Popen:
    """A run that takes a second per step, with a digest line per step in ``log``; its
    workers make every chunk (no warm start), so they run by its first step."""
    return subprocess.Popen(
        ingest(["run", str(job), "--no-progress", "--step-time", "1", "--digest-log", str(log),
                "--no-warm-start", *extra]),
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL, text=True)


def wait_for_steps(proc: subprocess.Popen, log: Path, n: int, timeout: float = RUN_TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while not (log.exists() and len(log.read_text().splitlines()) >= n):
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before step {n}:\n"
                        f"{proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no step {n} within {timeout} s")
        time.sleep(0.2)


def stream_workers(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if "StreamWorker" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def test_a_sigkilled_driver_leaves_no_process_of_its_cluster(job, ray_tmp, tmp_path):
    log = tmp_path / "steps.txt"
    proc = start_slow_run(job, env_for(ray_tmp), log)
    try:
        wait_for_steps(proc, log, 1)
        (temp_dir,) = own_temp_dirs(ray_tmp)
        driver = psutil.Process(proc.pid)
        # The GCS, the raylet, the agents (named by the temp dir), and the workers below them.
        procs = {p.pid: p for p in processes_mentioning(str(temp_dir))}
        for p in list(procs.values()) + [driver]:
            procs.update({c.pid: c for c in p.children(recursive=True)})
        procs.pop(proc.pid, None)
        assert len(stream_workers(list(procs.values()))) == 2, [p.cmdline() for p in procs.values()]
        assert any("gcs_server" in " ".join(p.cmdline()) for p in procs.values())
        proc.kill()
        proc.wait(timeout=30)
        left = wait_gone(list(procs.values()), EXIT_BOUND_S)
        assert not left, f"alive {EXIT_BOUND_S} s after the driver's SIGKILL: " + ", ".join(
            f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in left)
        assert not _alive(processes_mentioning(str(temp_dir)))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_sigkilled_driver_on_a_given_cluster_leaves_no_worker(job, ray_tmp, head, tmp_path):
    head_before = {p.pid for p in head.processes()}
    log = tmp_path / "steps.txt"
    # The head has one CPU; the run asks for one worker.
    proc = start_slow_run(job, env_for(ray_tmp), log, "--address", head.address,
                          "--workers", "1")
    try:
        wait_for_steps(proc, log, 1)
        raylets = [p for p in head.processes() if "raylet" in " ".join(p.cmdline())]
        workers = stream_workers([c for r in raylets for c in r.children(recursive=True)])
        assert len(workers) == 1
        proc.kill()
        proc.wait(timeout=30)
        left = wait_gone(workers, EXIT_BOUND_S)
        assert not left, f"worker {[p.pid for p in left]} alive {EXIT_BOUND_S} s after SIGKILL"
        assert head_before <= {p.pid for p in head.processes()}  # the cluster itself stays
        assert head.answers() == (7, 1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# Each signal while feeding; and one of them while importing, the other while Ray starts.
@pytest.mark.parametrize("sig,code,after_s", [
    (signal.SIGTERM, 143, 1.0), (signal.SIGINT, 130, 3.0),
    (signal.SIGINT, 130, None), (signal.SIGTERM, 143, None)])
def test_a_signal_at_any_point_exits_with_one_line(job, ray_tmp, tmp_path, sig, code, after_s):
    log = tmp_path / "steps.txt"
    proc = start_slow_run(job, env_for(ray_tmp), log)
    try:
        if after_s is None:
            wait_for_steps(proc, log, 1)
        else:
            time.sleep(after_s)
        driver_tree = [psutil.Process(proc.pid)]
        driver_tree += driver_tree[0].children(recursive=True)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == \
        f"ingest: interrupted ({signal.Signals(sig).name}); stopped"
    assert not wait_gone(driver_tree[1:], EXIT_BOUND_S)
    assert not _alive(processes_mentioning(str(ray_tmp)))
    assert own_temp_dirs(ray_tmp) == []


SWALLOWED = r"""
import os, signal, time
from actors.ray_cluster import Interrupted, exit_on_signals

class SignalledWhileCollected:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)  # handled inside __del__, which swallows raises
        for _ in range(10_000):
            pass

try:
    with exit_on_signals():
        SignalledWhileCollected()
        time.sleep(30)
    print("not interrupted")
except Interrupted as e:
    print("interrupted", e.signum)
"""


def test_a_signal_handled_inside_a_destructor_still_interrupts(ray_tmp):
    """Python swallows what a __del__ or a gc callback (JAX has one) raises; the signal must
    not be lost there."""
    out = subprocess.run([sys.executable, "-c", SWALLOWED], env=env_for(ray_tmp), cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["interrupted", str(int(signal.SIGTERM))], out.stderr[-2000:]
    assert "Exception ignored" not in out.stderr


# A thread holds the import lock of `ray` for 15 s, as a signal that interrupted an import can
# leave it held for good; the command, on its way out of an error, must not wait for Ray.
IMPORT_HELD = r"""
import importlib._bootstrap as bootstrap, sys, threading, time
assert "ray" not in sys.modules
held, release = threading.Event(), threading.Event()

def hold():
    with bootstrap._ModuleLockManager("ray"):
        held.set()
        release.wait(15)

threading.Thread(target=hold, daemon=True).start()
held.wait()
from actors.ray_cluster import RayStarter
starter = RayStarter(None, 1)
time.sleep(0.5)  # the thread is waiting for the lock now
t0 = time.monotonic()
starter.join(abandon=True)
print("joined after", round(time.monotonic() - t0, 2))
release.set()
time.sleep(3)  # the import goes on: the thread must not start Ray after it
print("ray started:", sys.modules["ray"].is_initialized())
"""


def test_an_error_exit_does_not_wait_for_a_ray_import_that_never_ends(ray_tmp):
    out = subprocess.run([sys.executable, "-c", IMPORT_HELD], env=env_for(ray_tmp), cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stderr[-2000:]
    assert float(lines[0].split()[-1]) < 2.0, lines  # not the 15 s the lock is held
    assert lines[1] == "ray started: False"
    assert own_temp_dirs(ray_tmp) == []
