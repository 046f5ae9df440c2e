"""Several JAX hosts: joining them, agreeing on the last step of finite data, local launching.

Every host runs its own ``HostFeed`` for the streams whose rows land on its devices; hosts do
not coordinate to feed a step. Only the end of finite data needs agreement: a host whose
streams are exhausted keeps delivering all-padding blocks for them while any other host still
has rows, and every host stops after the same step, the last one with a row anywhere.

The agreement is a tiny allgather of each host's *claim*, the last step it knows to have a
row: the step it just assembled plus what the rows already in hand (the current chunk of each
stream, the batches assembled ahead) cover. Rows of a stream never come back once it is
exhausted, so a claim of step c vouches for every step up to c, and every host may deliver up
to the largest claim without asking again::

    step              1   2   3   4   5   6
    host 0 has rows   y   y   y   -   -   -        (- : all its streams are exhausted)
    host 1 has rows   y   y   y   y   y   -
    sync at step 1:   claims (2, 3) -> steps 1..3 go ahead without asking
    sync at step 4:   claims (3, 5) -> steps 4..5 go ahead; host 0 pads them
    sync at step 6:   claims (3, 5) -> 5 < 6: every host stops after step 5

With ``drop_remainder`` a claim is instead the last step a host knows to be *full* (every
owned stream has its rows), and the hosts go on through the smallest claim: the first step in
which any host would pad is dropped everywhere. A host claims at least the step it just
assembled while that step is full, so a claim below the step asked about is final::

    step              1   2   3   4
    host 0 full       y   y   y   -                (- : a stream of host 0 has run out)
    host 1 full       y   y   y   y
    sync at step 1:   claims (3, 4) -> min 3: steps 1..3 go ahead without asking
    sync at step 4:   claims (3, 4) -> 3 < 4: every host stops after step 3

Every host makes the same decisions from the same gathered claims, so the steps delivered do
not depend on timing, only on (config, corpus, seed), exactly as on one host. The allgather is
made from the consumer's thread, which waits for it, in program order with the training step's
own collectives. A peer that died makes it fail: at once when its sockets close, within 30 s
(gloo's connection timeout) when it died before the first collective; the error names what was
awaited. A peer that stalls without dying (a hung step, a debugger) would hold the others in the
collective for good, and a collective cannot be cancelled: it runs on a helper thread, and the
consumer gives up after ``agreement_timeout_s`` (``AGREEMENT_TIMEOUT_S`` by default), naming the
processes that never arrived (each marks its arrival in the key-value store of JAX's
coordination service).

``ingest run --hosts N`` starts N local JAX processes on 127.0.0.1 with
``--devices-per-host`` forced CPU devices each (``launch_local_hosts``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jax_side.private_api import cluster_types, coordination_client

__all__ = [
    "AGREEMENT_TIMEOUT_S", "EndAgreement", "PeerError", "allgather", "allgather_json",
    "combine_stats", "detected_cluster", "global_batch", "initialize", "launch_local_hosts",
    "leave",
]

log = logging.getLogger("ingest.multihost")

# How long the launcher lets the other hosts end on their own after one failed: a host whose
# peer died fails its next collective within milliseconds, and JAX's coordination service
# stops every process within its heartbeat timeout (100 s by default) in any case.
PEER_EXIT_GRACE_S = 60.0

# How long a host waits for the others at the end-of-data agreement. Hosts reach it a training
# step apart at most, unless one is stuck: twice HostFeed's get_timeout_s (300 s), so that a
# peer waiting on its own slow chunk fails first, with the error that names it.
AGREEMENT_TIMEOUT_S = 600.0

_LAUNCHER_FLAGS = ("--hosts", "--devices-per-host")


class ClusterJoinError(RuntimeError):
    """This process could not join the JAX processes of the cluster environment it is in."""


class PeerError(RuntimeError):
    """A collective between the JAX processes failed: a peer died, left or broke off.

    Attributes:
      what: what this process waited for.
    """

    def __init__(self, message: str, *, what: str):
        super().__init__(message)
        self.what = what


def _peer_error(what: str, e: Exception) -> PeerError:
    n = jax.process_count()
    return PeerError(
        f"process {jax.process_index()} of {n} waited for {what} from every process and the "
        f"allgather failed: {e}. Another process has probably died or left (see its log). "
        f"Restart all {n} processes and restore the last feed checkpoint (ingest run: "
        f"--resume)", what=what)


def allgather(x: np.ndarray, what: str) -> np.ndarray:
    """``x`` from every process, stacked along a new first axis (process order).

    Args:
      x: a small array of the same shape and dtype on every process.
      what: what the processes exchange, for the error message.

    Raises:
      PeerError: the collective failed, naming ``what`` and this process.
    """
    try:
        return np.asarray(multihost_utils.process_allgather(x))
    except jax.errors.JaxRuntimeError as e:
        raise _peer_error(what, e) from e


def bounded_allgather(x: np.ndarray, what: str, *, timeout_s: float, key: str,
                      setting: str, how: str) -> np.ndarray:
    """``allgather``, giving up after ``timeout_s``: a peer that stalls without dying holds an
    XLA collective for good, and it cannot be cancelled. The collective runs on a helper thread
    (this thread waits for it, so program order is kept); each process marks its arrival under
    ``key`` in the coordination service's key-value store, so the error names those that never
    came. After a timeout the helper thread stays blocked: the process should exit
    (``leave``), as after any ``PeerError``.

    Args:
      x: a small array of the same shape and dtype on every process.
      what: what the processes exchange, for the error message.
      timeout_s: the longest wait for every process.
      key: unique to this exchange and the same on every process.
      setting: the name of the setting ``timeout_s`` comes from, for the error message.
      how: where the user changes it, for the error message.

    Raises:
      PeerError: the collective failed, or did not finish within ``timeout_s``.
    """
    client = coordination_client()
    me, n = jax.process_index(), jax.process_count()
    if client is not None:
        try:
            client.key_value_set(f"{key}/{me}", "arrived")
        except Exception as e:  # noqa: BLE001 -- process 0, which holds the store, may be gone
            log.debug("cannot mark the arrival %s/%d: %s", key, me, e)
            client = None
    done: queue.Queue = queue.Queue()

    def gather() -> None:
        try:
            done.put(allgather(x, what))
        except BaseException as e:  # noqa: BLE001 -- handed to the waiting thread
            done.put(e)

    threading.Thread(target=gather, name="allgather", daemon=True).start()
    try:
        out = done.get(timeout=timeout_s)
    except queue.Empty:
        missing = _not_arrived(client, key, n)
        who = (f"process(es) {missing} of {n} never arrived: stalled without dying (a hung "
               f"or very slow step, a debugger) or cut off" if missing else
               "another process never arrived")
        raise PeerError(
            f"process {me} of {n} waited {timeout_s:g} s for {what} from every process; "
            f"{who}. That is the limit {setting}={timeout_s:g}: raise it ({how}) if a host's "
            f"steps may take that long, else restart all {n} processes and restore the last "
            f"feed checkpoint (ingest run: --resume)", what=what) from None
    if isinstance(out, BaseException):
        raise out
    if client is not None:
        # Every process has arrived: the mark is not needed any more (one per exchange).
        try:
            client.key_value_delete(f"{key}/{me}")
        except Exception as e:  # noqa: BLE001 -- a leftover mark costs a few bytes
            log.debug("cannot delete the arrival mark %s/%d: %s", key, me, e)
    return out


def _not_arrived(client, key: str, n: int) -> list[int]:
    """The processes without an arrival mark under ``key`` ([] when that cannot be told)."""
    if client is None:
        return []
    try:
        marks = client.key_value_dir_get(f"{key}/")
    except Exception as e:  # noqa: BLE001 -- the service may be gone with its process
        log.warning("cannot read the arrival marks under %s: %s", key, e)
        return []
    arrived = {int(k.rsplit("/", 1)[1]) for k, _ in marks}
    return [i for i in range(n) if i not in arrived]


def global_batch(batch: dict[str, jax.Array], step: int) -> dict[str, np.ndarray]:
    """The global batch as numpy on this process, rows in global order (for digests).

    A collective when the arrays span several processes: every process must call it.
    """
    if all(a.is_fully_addressable for a in batch.values()):
        return {k: np.asarray(v) for k, v in batch.items()}
    what = f"the global batch of step {step} (for --digest / --digest-log)"
    try:
        gathered = multihost_utils.process_allgather(batch, tiled=True)
    except jax.errors.JaxRuntimeError as e:
        raise _peer_error(what, e) from e
    return {k: np.asarray(v) for k, v in gathered.items()}


def allgather_json(obj: Any, what: str) -> list[Any]:
    """A JSON-serializable value from every process, in process order (two tiny allgathers:
    the lengths, then the padded UTF-8 bytes)."""
    data = np.frombuffer(json.dumps(obj, sort_keys=True).encode(), dtype=np.uint8)
    sizes = allgather(np.array([data.size], np.int32), what).reshape(-1)
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[:data.size] = data
    everything = allgather(buf, what)
    return [json.loads(everything[i, :n].tobytes()) for i, n in enumerate(sizes)]


class EndAgreement:
    """The hosts' agreement on the last step of finite data (see the module docstring).

    One per ``HostFeed`` when several JAX processes feed a mesh. Every host calls
    ``continues`` for every step it is about to deliver, in the same order.

    Args:
      drop_remainder: claims name the last step known to be full, and the hosts go on through
        the smallest claim (else: the last step known to have a row, through the largest).
      timeout_s: the longest wait for the other hosts at one comparison (``PeerError`` after).

    Attributes:
      syncs: allgathers made so far (fewer than the steps: a claim covers several steps).
    """

    def __init__(self, *, drop_remainder: bool = False,
                 timeout_s: float = AGREEMENT_TIMEOUT_S):
        if not timeout_s > 0:
            raise ValueError(f"agreement_timeout_s={timeout_s} must be positive")
        self._agreed_through = 0
        self._drop_remainder = drop_remainder
        self._timeout = timeout_s
        # The same on every process: every process makes the same agreements, in order.
        self._id = next(EndAgreement._made)
        self.syncs = 0

    _made = itertools.count()

    def continues(self, step: int, claim: int) -> bool:
        """Whether ``step`` goes ahead on every host.

        Args:
          step: the step about to be delivered (steps count from 1; resumed runs go on).
          claim: the last step this host knows to have a row (< ``step`` once its streams are
            exhausted: the last step it had a row); with ``drop_remainder``, the last step it
            knows to be full (``step - 1`` when ``step`` is not).

        Raises:
          PeerError: a peer died or left while the hosts compared claims, or did not come
            within ``timeout_s``.
        """
        if step <= self._agreed_through:
            return True
        kind = "full step" if self._drop_remainder else "step with rows"
        claims = bounded_allgather(
            np.array([claim], np.int32),
            f"the end-of-data agreement at step {step} (every process's last {kind})",
            timeout_s=self._timeout, key=f"ingest/agreement/{self._id}/{self.syncs}",
            setting="agreement_timeout_s",
            how="HostFeed(agreement_timeout_s=...), ingest run --agreement-timeout SECONDS")
        self.syncs += 1
        self._agreed_through = int(claims.min() if self._drop_remainder else claims.max())
        return self._agreed_through >= step


# -- joining the processes (ingest run --coordinator ... / a cluster environment) -------------


def detected_cluster() -> tuple[str, int | None] | None:
    """The cluster environment ``jax.distributed.initialize()`` would detect here, through
    JAX's own cluster classes (Cloud TPU, Kubernetes, SLURM, Open MPI, ...; not the opt-in
    mpi4py), and its process count (None if the environment cannot tell it without joining);
    None when there is none."""
    try:
        kinds = cluster_types()
    except (ImportError, AttributeError) as e:
        log.warning("cannot list JAX's cluster environments (%s); without --coordinator the "
                    "processes join only when jax.distributed.initialize() finds one", e)
        return None
    for kind in kinds:
        if kind.opt_in_only_method:
            continue
        try:
            if not kind.is_env_present():
                continue
        except Exception as e:  # noqa: BLE001 -- a probe that fails means "not here"
            log.debug("JAX cluster probe %s failed: %s", kind.__name__, e)
            continue
        try:
            count: int | None = int(kind.get_process_count())
        except Exception as e:  # noqa: BLE001 -- jax.distributed.initialize() will say why
            log.debug("%s cannot tell the process count before joining: %s", kind.__name__, e)
            count = None
        return kind.__name__, count
    return None


def initialize(coordinator: str | None, num_hosts: int | None, host_id: int | None) -> None:
    """Joins this process to the others with ``jax.distributed.initialize``, before anything
    touches a JAX device: with the three values from the command line, else with no arguments
    (JAX's own cluster detection) when JAX detects a cluster environment of several
    processes; else does nothing.

    Raises:
      ClusterJoinError: a cluster environment was detected but joining failed (naming it), or
        ``JAX_COORDINATOR_ADDRESS`` is set where no environment gives the process count and id.
    """
    if jax.distributed.is_initialized():
        return
    if coordinator is not None:
        log.info("joining %d JAX processes as process %d through %s", num_hosts, host_id,
                 coordinator)
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_hosts,
                                   process_id=host_id)
        return
    found = detected_cluster()
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if found is None:
        if address:
            raise ClusterJoinError(
                f"JAX_COORDINATOR_ADDRESS={address} is set, but no cluster environment JAX "
                f"detects (Cloud TPU, Kubernetes, SLURM, Open MPI) gives this process's count "
                f"and id. Start the processes under one of them, or pass --coordinator "
                f"{address} --num-hosts N --host-id I")
        return
    name, count = found
    if count is not None and count <= 1:
        log.info("cluster environment %s shows one process: running as a single host", name)
        return
    log.info("cluster environment %s (%s processes): joining through "
             "jax.distributed.initialize()", name, count if count is not None else "?")
    try:
        jax.distributed.initialize()
    except (ValueError, TypeError, RuntimeError) as e:
        raise ClusterJoinError(
            f"jax.distributed.initialize() failed in the cluster environment {name} that JAX "
            f"detected: {e}. Fix the environment, or pass --coordinator HOST:PORT --num-hosts N "
            f"--host-id I") from e


def leave(code: int) -> None:
    """Exits this process at once, after flushing its output.

    A process of a failed multi-process run must not linger: at a normal exit,
    ``jax.distributed`` waits at a shutdown barrier (up to 5 minutes) for every process, while
    those wait for this one in their next collective. Leaving closes its sockets, so the peers'
    collectives fail within milliseconds and they report it.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(code)


# -- one summary for every host ----------------------------------------------------------------

_SUMMED = ("tokens", "padding_rows", "padding_tokens", "dropped_rows", "dropped_tokens",
           "documents", "truncated_documents",
           "truncated_tokens", "workers", "pending_workers", "restarts", "cpu_waits", "streams",
           "workers_killed", "tokens_per_s",
           "steady_tokens_per_s", "object_store_bytes_bound", "object_store_bytes_peak")
_PER_KEY = ("rows_per_s_by_worker", "rows_per_s_by_stream")
_WORST = ("stall_fraction", "steady_stall_fraction", "startup_s", "wait_s", "wait_max_s",
          "cpu_wait_s")


def combine_stats(per_host: list[dict[str, Any]]) -> dict[str, Any]:
    """One run summary from every host's ``HostFeed.stats()`` summary.

    Counts add up over hosts (tokens, padding, documents, workers; ``tokens_per_s`` is the
    hosts' rates added); times take the worst host (``startup_s``, ``stall_fraction``, waits);
    per-worker and per-stream rates are merged (a worker name two hosts use gets the host index
    as a prefix, ``1/w0``); any other value is host 0's. Steps,
    digest and backend are the same on every host, which is checked.

    Raises:
      RuntimeError: the hosts disagree on a value that must be the same (a bug).
    """
    out = dict(per_host[0])
    for key in ("steps", "first_step", "last_step", "digest", "backend"):
        values = [h.get(key) for h in per_host]
        if len(set(map(json.dumps, values))) > 1:
            raise RuntimeError(f"the hosts disagree on {key!r}: {values}; the multi-host "
                               f"end-of-data agreement should prevent this; this is a bug in "
                               f"jax_side.multihost")
    for key in _SUMMED:
        if key in out:
            out[key] = sum(h[key] for h in per_host)
    for key in _WORST:
        if key in out:
            out[key] = max(h[key] for h in per_host)
    skipped: dict[str, dict[str, int]] = {}
    skipped_rows: dict[str, int] = {}
    for h in per_host:
        for reason, per_file in h.get("skipped_documents", {}).items():
            for path, n in per_file.items():
                skipped.setdefault(reason, {})
                skipped[reason][path] = skipped[reason].get(path, 0) + n
        for path, n in h.get("skipped_rows_of_bad_files", {}).items():
            skipped_rows[path] = skipped_rows.get(path, 0) + n
    for key in _PER_KEY:
        if key not in out:
            continue
        names = [name for h in per_host for name in h[key]]
        out[key] = {(name if names.count(name) == 1 else f"{i}/{name}"): v
                    for i, h in enumerate(per_host) for name, v in h[key].items()}
    out["skipped_documents"] = skipped
    out["skipped_rows_of_bad_files"] = skipped_rows
    out["skipped_files"] = sorted({p for h in per_host for p in h.get("skipped_files", [])})
    out["hosts"] = len(per_host)
    return out


# -- ingest run --hosts N: N local processes ---------------------------------------------------


def _free_port() -> int:
    # The port is free now; process 0's coordinator binds it a moment later (a small race
    # that only a busy machine loses, with a clear bind error).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _strip_launcher_flags(argv: list[str]) -> list[str]:
    """``argv`` without ``--hosts N`` and ``--devices-per-host D`` (also ``--flag=value`` and
    the abbreviations argparse accepted), everything else in order."""
    p = argparse.ArgumentParser(add_help=False)
    for flag in _LAUNCHER_FLAGS:
        p.add_argument(flag)
    _, rest = p.parse_known_args(argv)
    return rest


def _child_env(devices_per_host: int) -> dict[str, str]:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count="
                                           f"{devices_per_host}"])
    env["JAX_PLATFORMS"] = "cpu"
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def launch_local_hosts(argv: list[str], args: argparse.Namespace, *,
                       workers_per_host: int) -> int:
    """``ingest run --hosts N``: runs the same command as N JAX processes on this machine.

    Each process gets ``--coordinator 127.0.0.1:PORT --num-hosts N --host-id I`` and
    ``args.devices_per_host`` forced CPU devices. With ``--backend ray`` and no cluster given,
    one local Ray cluster is started here and every process joins it. Process 0 prints the one
    summary (stdout, like a single process); the others' output goes to stderr.

    Args:
      argv: the command line as given (without the program name).
      args: its parsed values.
      workers_per_host: Ray workers each process starts.

    Returns:
      0 when every process succeeded, else the first failing process's status.
    """
    child_argv = _strip_launcher_flags(argv)
    n = args.hosts
    ray_started = False
    if args.backend == "ray" and not (args.address or os.environ.get("RAY_ADDRESS")):
        import ray

        from jax_side.ray_cluster import start_ray

        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
        # Logical CPUs: every host's workers must be placeable, else actors wait forever for
        # CPUs; a small machine runs them oversubscribed (slower, same batches). A cluster of
        # this command's own, which every process joins by its address.
        start_ray(None, num_cpus=max(os.cpu_count() or 1, n * workers_per_host))
        ray_started = True
        child_argv += ["--address", ray.get_runtime_context().gcs_address]
    coordinator = f"127.0.0.1:{_free_port()}"
    env = _child_env(args.devices_per_host)
    procs: list[subprocess.Popen] = []
    ended: queue.Queue = queue.Queue()
    try:
        for i in range(n):
            cmd = [sys.executable, "-m", "jax_side.run", *child_argv, "--coordinator",
                   coordinator, "--num-hosts", str(n), "--host-id", str(i)]
            # Process 0's stdout is this command's (its summary is the last line); the others
            # print nothing there but Ray's or JAX's chatter, sent to stderr instead.
            p = subprocess.Popen(cmd, env=env, stdout=None if i == 0 else sys.stderr)
            procs.append(p)
            threading.Thread(target=lambda i=i, p=p: ended.put((i, p.wait())), daemon=True,
                             name=f"wait-host-{i}").start()
        status = 0
        for _ in range(n):
            try:
                i, code = ended.get(timeout=PEER_EXIT_GRACE_S if status else None)
            except queue.Empty:
                stuck = [i for i, p in enumerate(procs) if p.poll() is None]
                print(f"ingest: error: host(s) {stuck} of {n} still running "
                      f"{PEER_EXIT_GRACE_S:.0f} s after another failed; killing them",
                      file=sys.stderr)
                break
            if code and not status:
                print(f"ingest: error: host {i} of {n} exited with status {code}; the others "
                      f"stop at their next collective", file=sys.stderr)
                status = code if code > 0 else 128 - code
        return status
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if ray_started:
            import ray

            ray.shutdown()
