"""``ingest run``: the feed on a mesh of all devices, with progress, summary and digest.

With several JAX processes (``--coordinator``/``--num-hosts``/``--host-id``, a cluster
environment, or ``--hosts N`` locally: ``jax_side.host_join``, ``jax_side.local_hosts``), the
mesh spans every process's devices, digests hash the gathered global batches, and process 0
prints one summary.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ingest.cli import parse_args
from ingest.config import Config, ConfigError, load_config
from ingest.demo import demo_config
from ingest.digest import BatchDigest, step_digest
from ingest.errors import BadInputError, StreamError
from jax_side import run_summary
from jax_side.ray_cluster import (
    ClusterUnreachableError,
    Interrupted,
    RayStarter,
    exit_on_signals,
    prepare_ray_environment,
    start_ray,
)

__all__ = ["main", "run_command", "start_ray"]

log = logging.getLogger("ingest")


def _process_start_time() -> float:
    """Wall-clock time this process started, to 10 ms: its age from /proc (process start and
    uptime share the boot clock), subtracted from now. psutil's create_time rests on a boot
    time in whole seconds and overstated startup by up to 1 s."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


_IMPORTED_AT = time.time()


def run_command(args) -> int:
    t_start = _process_start_time()

    overrides = {"workers": args.workers}
    # A config file is read before Ray starts (about 10 ms), to size a local cluster.
    cfg = load_config(args.config, **overrides) if args.config else None
    ray_started = None
    if args.backend == "ray":
        # Workers take one CPU each: a local cluster gets at least one per worker asked for.
        workers = cfg.workers if cfg is not None else args.workers
        ray_started = RayStarter(args.address, max(os.cpu_count() or 1, workers or 0))
    held = contextlib.ExitStack()  # the checkpoint directory's lock, for the whole run
    try:
        # The feed makes its first chunks in this process while Ray starts (warm start).
        warm = ray_started is not None and not args.no_warm_start
        opened = _open_feed(args, cfg, overrides, held, ray_started.wait if warm else None)
    except BaseException:
        held.close()
        if ray_started is not None:
            ray_started.join(abandon=True)  # never exit with ray.init half done
        raise
    if opened is None:  # the batch does not fit the devices (the message is printed)
        if ray_started is not None:
            ray_started.join(abandon=True)
        return 2
    feed, manager = opened
    if ray_started is not None and not warm:
        ray_started.wait()
    start_step = feed.get_state()["step"]
    digest = BatchDigest() if args.digest else None
    try:
        step, first_batch_at, killed = _feed_loop(args, feed, manager, digest, start_step)
    finally:
        if manager is not None:
            manager.wait_until_finished()
        held.close()
        stats = feed.stats()
        feed.close()
        # A run whose data ended while its own local cluster was starting (the warm start
        # made every row) does not wait for it: the cluster's reaper stops it at exit. A
        # cluster joined is waited for, so that a wrong address fails the run.
        ray_up = ray_started is None or ray_started.is_up() or not ray_started.starts_local
        if ray_up and ray_started is not None:
            ray_started.join()
        ray = sys.modules.get("ray")  # None where Ray did not import
        if args.backend == "ray" and ray is not None and ray_up:
            # Ray's log monitor prints to stdout asynchronously (worker deaths, say): disconnect
            # first, so that with --json the summary really is the last line.
            ray.shutdown()
    if ray_started is not None and ray_up:
        ray_started.wait()  # a Ray that failed to start fails the run
    if args.backend == "ray":
        stats["ray_up"] = ray_up
    stats["startup_s"] = (first_batch_at - t_start) if first_batch_at else float("nan")
    if killed is not None:
        stats["workers_killed"] = killed
    stats["first_step"] = start_step
    stats["last_step"] = step
    if digest is not None:
        stats["digest"] = digest.hexdigest()
    return run_summary.report(args, stats, start_step)


def _open_feed(args, cfg: Config | None, overrides: dict[str, Any], held: contextlib.ExitStack,
               await_ray: Callable[[], None] | None):
    """Joins the JAX processes, builds the feed over all devices (on the demo when ``cfg`` is
    None), opens the checkpoint directory (locked by the lead process, in ``held``) and
    restores it with ``--resume``. Returns ``(feed, manager)`` (manager None without
    ``--checkpoint-dir``), or None when the batch does not divide over the devices (after
    printing why)."""
    import jax

    from jax_side import host_join
    from jax_side.feed import HostFeed
    from jax_side.sharding import batch_sharding

    # Before anything touches a JAX device, so that the device list is the global one.
    host_join.initialize(args.coordinator, args.num_hosts, args.host_id)
    if cfg is None:
        cfg = demo_config(**overrides)
    devices = jax.devices()
    if cfg.global_batch_size % len(devices):
        print(f"ingest: error: global_batch_size={cfg.global_batch_size} is not divisible "
              f"by the {len(devices)} devices; change global_batch_size", file=sys.stderr)
        return None
    mesh = jax.make_mesh((len(devices),), ("data",))
    timeouts = ({} if args.agreement_timeout is None
                else {"agreement_timeout_s": args.agreement_timeout})
    feed = HostFeed(cfg, sharding=batch_sharding(mesh, "data"), backend=args.backend,
                    await_ray=await_ray, **timeouts)
    if not args.checkpoint_dir:
        return feed, None
    from jax_side import checkpoint

    if jax.process_index() == 0:
        # One run per checkpoint directory: a second one would interleave its steps.
        held.enter_context(checkpoint.lock_directory(args.checkpoint_dir))
    manager = checkpoint.open_manager(args.checkpoint_dir)
    if args.resume:
        restored = checkpoint.restore_latest_feed(manager)
        if restored is not None:
            feed.set_state(restored)
            print(f"ingest: resumed at step {restored['step']} from {args.checkpoint_dir}",
                  file=sys.stderr)
        else:
            print(f"ingest: no checkpoint in {args.checkpoint_dir}; starting fresh",
                  file=sys.stderr)
    return feed, manager


def _feed_loop(args, feed, manager, digest: BatchDigest | None, start_step: int
               ) -> tuple[int, float | None, int | None]:
    """Takes batches until ``--steps`` or the end of data: digests, checkpoints, the progress
    bar, the simulated step, the worker killer. Returns the last step, the time of the first
    batch (None if none came) and the workers killed (None without ``--kill-worker-every``)."""
    import jax

    from jax_side import multihost

    lead = jax.process_index() == 0
    digest_log = (open(args.digest_log, "a", encoding="utf-8") if args.digest_log and lead
                  else None)
    bar = None
    if not args.no_progress and lead:
        from tqdm import tqdm

        total = (args.steps - start_step) if args.steps else None
        bar = tqdm(total=total, unit="step", file=sys.stderr, dynamic_ncols=True,
                   desc="ingest run", disable=None)
    step = saved = start_step
    first_batch_at = None
    killer = None
    if args.kill_worker_every:
        from actors.faults import WorkerKiller  # noqa: PLC0415 (imports Ray)

        killer = WorkerKiller(args.kill_worker_every)
    try:
        done = args.steps is not None and step >= args.steps
        for batch in () if done else feed:
            if first_batch_at is None:
                first_batch_at = time.time()
            step += 1
            if digest is not None or args.digest_log:
                host = multihost.global_batch(batch, step)  # every process takes part
                if digest is not None:
                    digest.update(host)
                if digest_log is not None:
                    digest_log.write(f"{step} {step_digest(host)}\n")
                    digest_log.flush()
            if manager is not None and args.checkpoint_every and step % args.checkpoint_every == 0:
                _save(manager, step, feed)
                saved = step
            if bar is not None:
                _advance(bar, feed, step)
            if args.step_time:
                time.sleep(args.step_time)  # the simulated training step
            if args.steps is not None and step >= args.steps:
                break
        # The end of a run is a checkpoint too, so a finished run resumes where it stopped.
        if manager is not None and step > saved:
            _save(manager, step, feed)
    finally:
        if killer is not None:
            killer.stop()
        if bar is not None:
            bar.close()
        if digest_log is not None:
            digest_log.close()
    return step, first_batch_at, (killer.killed if killer is not None else None)


def _save(manager, step: int, feed) -> None:
    # Imported here: orbax takes about 0.7 s to import, before the first batch of every run
    # that saves nothing.
    from jax_side import checkpoint

    checkpoint.save_feed(manager, step, feed.get_state())


def _advance(bar, feed, step: int) -> None:
    """One step on the progress bar; the rate every 10 steps."""
    bar.update(1)
    if step % 10 == 0:
        span = time.perf_counter() - (feed.counters.first_batch_time or time.perf_counter())
        bar.set_postfix_str(f"{feed.counters.tokens / max(1e-9, span):,.0f} tok/s",
                            refresh=False)


def prepare_environment(args) -> None:
    """Process-wide settings that must precede ``import ray``.

    A cluster this command starts itself (no --address, no $RAY_ADDRESS) listens on 127.0.0.1
    only, and a head given at a loopback address that listens there only is reached there
    (``ray_cluster.prepare_ray_environment``).
    """
    prepare_ray_environment(getattr(args, "address", None) or os.environ.get("RAY_ADDRESS"))


def main(argv: list[str] | None = None) -> int:
    """The ``ingest`` console script.

    SIGINT and SIGTERM end it at any point with one line and status ``128 + signal``
    (130 for Ctrl-C), after the cleanups (a local Ray cluster is stopped).
    """
    on_main_thread = threading.current_thread() is threading.main_thread()
    try:
        with exit_on_signals() if on_main_thread else contextlib.nullcontext():
            return _main(argv)
    except KeyboardInterrupt as e:
        code = e.exit_code if isinstance(e, Interrupted) else 128 + signal.SIGINT
        print(f"ingest: interrupted ({signal.Signals(code - 128).name}); stopped",
              file=sys.stderr)
        _leave_if_distributed(code)
        return code


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    prepare_environment(args)
    from jax_side.host_join import ClusterJoinError  # noqa: PLC0415
    from jax_side.multihost import PeerError  # noqa: PLC0415
    logging.basicConfig(level=logging.WARNING, datefmt="%Y-%m-%d %H:%M:%S",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("ingest").setLevel(logging.INFO)
    try:
        if args.command == "bench":
            return _bench(sys.argv[1:] if argv is None else list(argv))
        if args.command == "materialize":
            from jax_side.materialize import materialize_command  # noqa: PLC0415

            return materialize_command(args)
        if args.hosts:
            from jax_side.local_hosts import launch_local_hosts

            cfg = load_config(args.config) if args.config else demo_config()
            return launch_local_hosts(sys.argv[1:] if argv is None else list(argv), args,
                                      workers_per_host=args.workers or cfg.workers)
        return run_command(args)
    except (ConfigError, BadInputError, StreamError, FileNotFoundError, ValueError,
            TimeoutError, PeerError, ClusterJoinError, ClusterUnreachableError) as e:
        # Input and config problems, a peer that left, a cluster that is gone: the message
        # names the fix; no traceback.
        print(f"ingest: error: {_host()}{e}", file=sys.stderr)
        _leave_if_distributed(1)
        return 1
    except KeyboardInterrupt:
        raise
    except BaseException:
        _leave_if_distributed(1, print_traceback=True)
        raise


def _bench(argv: list[str]) -> int:
    """``ingest bench``: the harness in the source checkout's benchmarks/ (not an installed
    package), run as its own program, ``python -m benchmarks.bench``: the product never
    imports it. Returns its exit status."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isfile(os.path.join(root, "benchmarks", "bench.py")):
        raise ValueError(f"`ingest bench` needs the source checkout's benchmarks/ folder next to "
                         f"jax_side/ (not found in {root}); run it from a clone of the repository")
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "benchmarks.bench", *argv[argv.index("bench") + 1:]]
    return subprocess.run(cmd, env={**os.environ, "PYTHONPATH": path}, check=False).returncode


def _host() -> str:
    """``host I of N: `` in a multi-process run, else nothing."""
    if "jax" not in sys.modules:  # an interrupt while JAX is imported: never distributed
        return ""
    import jax

    if not jax.distributed.is_initialized():
        return ""
    return f"host {jax.process_index()} of {jax.process_count()}: "


def _leave_if_distributed(code: int, *, print_traceback: bool = False) -> None:
    """A failed process of a multi-process run leaves at once (see ``host_join.leave``)."""
    if _host():
        from jax_side.host_join import leave

        if print_traceback:
            import traceback

            traceback.print_exc()
        leave(code)


if __name__ == "__main__":
    sys.exit(main())
