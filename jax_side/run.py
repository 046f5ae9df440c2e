"""``ingest run``: the feed on a mesh of all devices, with progress, summary and digest.

With several JAX processes (``--coordinator``/``--num-hosts``/``--host-id``, a cluster
environment, or ``ingest-dev run --hosts N`` locally: ``jax_side.host_join``,
``jax_side.local_hosts``), the mesh spans every process's devices, digests hash the gathered
global batches, and process 0 prints one summary.

Progress goes to stderr: a bar on a terminal, else one log line every ``--log-every`` seconds
(a log file, ``ray job submit``, ``kubectl logs``). With ``--json`` the last line of stdout is
one JSON object, the summary or, for a run that failed, the error.
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

from actors.ray_cluster import (
    ClusterUnreachableError,
    Interrupted,
    RayStarter,
    exit_on_signals,
    prepare_ray_environment,
    start_ray,
)
from ingest.cli import config_from_args, parse_args
from ingest.config import Config, ConfigError
from ingest.digest import BatchDigest, step_digest
from ingest.errors import BadInputError, StreamError
from jax_side import run_summary

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


def run_command(args, *, make_lab: Callable[..., Any] | None = None) -> int:
    """Runs ``ingest run``; ``make_lab``: ``ingest-dev``'s ``jax_side.dev.Lab`` (its
    simulation flags), which this module never imports."""
    t_start = _process_start_time()

    # A config file is read before Ray starts (it is quick), to size a local cluster; the demo
    # (which writes its corpus on first use) is built while Ray starts.
    cfg = config_from_args(args) if args.config else None
    ray_started = None
    if args.backend == "ray":
        # Workers take one CPU each: a local cluster gets at least one per worker asked for.
        workers = cfg.runtime.workers if cfg is not None else args.workers
        if workers is None and isinstance((args.overrides or {}).get("workers"), int):
            workers = args.overrides["workers"]  # the demo's, checked once it is built
        ray_started = RayStarter(args.address, max(os.cpu_count() or 1, workers or 0))
    held = contextlib.ExitStack()  # the checkpoint directory's lock, for the whole run
    try:
        # The feed makes its first chunks in this process while Ray starts (warm start).
        warm = ray_started is not None and not args.no_warm_start
        opened = _open_feed(args, cfg, held, ray_started.wait if warm else None)
    except BaseException:
        held.close()
        if ray_started is not None:
            ray_started.join(abandon=True)  # never exit with ray.init half done
        raise
    feed, manager = opened
    if ray_started is not None and not warm:
        ray_started.wait()
    start_step = feed.get_state()["step"]
    digest = BatchDigest() if args.digest else None
    lab = None
    if make_lab is not None and (args.step_time or args.kill_worker_every):
        lab = make_lab(step_time_s=args.step_time, kill_worker_every_s=args.kill_worker_every)
    meter = run_summary.RunMeter(t_start, start_step=start_step)
    try:
        step = _feed_loop(args, feed, manager, digest, start_step, meter, lab)
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
        if not ray_up:
            # Ray's start goes on while this process leaves, and Ray's exit hook (ray.shutdown)
            # then cuts it short: the start fails halfway and logs so (an ERROR of services.py
            # whose connection to the cluster was reset under it). The run does not need that
            # cluster, so Ray's own loggers are silenced, through its documented "ray" logger.
            logging.getLogger("ray").setLevel(logging.CRITICAL + 1)
        ray = sys.modules.get("ray")  # None where Ray did not import
        if args.backend == "ray" and ray is not None and ray_up:
            # Ray's log monitor prints to stdout asynchronously (worker deaths, say): disconnect
            # first, so that with --json the summary really is the last line.
            ray.shutdown()
    if ray_started is not None and ray_up:
        ray_started.wait()  # a Ray that failed to start fails the run
    if args.backend == "ray":
        stats["ray_up"] = ray_up
    stats.update(meter.stats(step_time_s=args.step_time))
    if lab is not None:
        stats.update(lab.stats())
    stats["first_step"] = start_step
    stats["last_step"] = step
    stats["tokenizer"] = _special_tokens(feed.config)
    stats["runtime"] = _runtime_knobs(feed.config)
    if digest is not None:
        stats["digest"] = digest.hexdigest()
    return run_summary.report(args, stats, start_step)


class DevicesMismatchError(ValueError):
    """The global batch does not divide over the devices of the mesh (exit status 2)."""


def _open_feed(args, cfg: Config | None, held: contextlib.ExitStack,
               await_ray: Callable[[], None] | None):
    """Joins the JAX processes, builds the feed over all devices (on the demo when ``cfg`` is
    None), opens the checkpoint directory (locked by the lead process, in ``held``) and
    restores it with ``--resume``. Returns ``(feed, manager)`` (manager None without
    ``--checkpoint-dir``).

    Raises:
      DevicesMismatchError: the batch does not divide over the devices.
    """
    import jax

    from jax_side import host_join
    from jax_side.feed import HostFeed
    from jax_side.sharding import batch_sharding

    # Before anything touches a JAX device, so that the device list is the global one.
    host_join.initialize(args.coordinator, args.num_hosts, args.host_id)
    if cfg is None:
        cfg = config_from_args(args)
    devices = jax.devices()
    if cfg.global_batch_size % len(devices):
        raise DevicesMismatchError(f"global_batch_size={cfg.global_batch_size} is not divisible "
                                   f"by the {len(devices)} devices; change global_batch_size")
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


def _feed_loop(args, feed, manager, digest: BatchDigest | None, start_step: int,
               meter: run_summary.RunMeter, lab) -> int:
    """Takes batches until ``--steps`` or the end of data: digests, checkpoints, progress on
    stderr, the meter of the summary's rates, and ``ingest-dev``'s simulated step and worker
    killer (``lab``, a ``jax_side.dev.Lab`` or None). Returns the last step."""
    import jax

    from jax_side import multihost

    lead = jax.process_index() == 0
    digest_log = (open(args.digest_log, "a", encoding="utf-8") if args.digest_log and lead
                  else None)
    progress = None
    if not args.no_progress and lead:
        progress = _Progress(feed, start_step, args.steps, args.log_every,
                             step_time_s=args.step_time)
    step = saved = start_step
    if lab is not None:
        lab.start(feed)
    try:
        done = args.steps is not None and step >= args.steps
        for batch in () if done else feed:
            step += 1
            meter.batch(feed.counters, lambda: _workers_run(feed))
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
            if progress is not None:
                progress.update(step)
            if lab is not None:
                lab.after_batch()
            if args.steps is not None and step >= args.steps:
                break
        # The end of a run is a checkpoint too, so a finished run resumes where it stopped.
        if manager is not None and step > saved:
            _save(manager, step, feed)
    finally:
        if lab is not None:
            lab.stop()
        if progress is not None:
            progress.close()
        if digest_log is not None:
            digest_log.close()
    return step


def _special_tokens(config: Config) -> dict[str, Any]:
    """The ids the run put around documents, and why (the tokenizer is cached where this
    process loaded it)."""
    from ingest.tokenize.tokenizer import bos_id_of, load_tokenizer  # noqa: PLC0415

    tok = load_tokenizer(config.tokenizer, config.runtime.tokenizer_backend)
    return {"name": tok.name, "eos_id": tok.eos_id, "bos_id": bos_id_of(tok, config.bos),
            "bos": config.bos, "reason": tok.specials_reason}


def _runtime_knobs(config: Config) -> dict[str, Any]:
    """The knobs the run resolved (``ingest.runtime.resolve_runtime``), and the reason for
    each automatic one."""
    from ingest.runtime import AUTO_FIELDS, resolve_runtime  # noqa: PLC0415

    runtime = resolve_runtime(config)
    return {**{n: getattr(runtime, n) for n in AUTO_FIELDS}, "reasons": dict(runtime.reasons)}


def _workers_run(feed) -> bool:
    """Whether the chunks now come from where they come for the rest of the run: at once
    without a warm start; with one, once the Ray workers have taken the streams over (the
    warm start's source holds its pool from then on)."""
    return not feed.warming


class _Progress:
    """Progress on stderr: a tqdm bar on a terminal; elsewhere (a log file, ``ray job
    submit``, ``kubectl logs``) one INFO log line every ``every_s`` seconds with the step, the
    tokens, the rate over the last interval, the stall behind a simulated training step, the
    workers and, where the run's length is known, the ETA."""

    def __init__(self, feed, start_step: int, steps: int | None, every_s: float, *,
                 step_time_s: float):
        self._feed = feed
        self._start_step = start_step
        self._steps = steps
        self._every = every_s
        self._step_time = step_time_s
        self._total: int | None = steps
        self._length_known = steps is not None
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=(steps - start_step) if steps else None, unit="step",
                             file=sys.stderr, dynamic_ncols=True, desc="ingest run")
        now = time.perf_counter()
        self._last = (now, 0, 0.0)  # (time, tokens, waited) at the last line

    def update(self, step: int) -> None:
        if self._bar is not None:
            self._bar.update(1)
            if step % 10 == 0:
                counters = self._feed.counters
                span = time.perf_counter() - (counters.first_batch_time or time.perf_counter())
                self._bar.set_postfix_str(f"{counters.tokens / max(1e-9, span):,.0f} tok/s",
                                          refresh=False)
            return
        now = time.perf_counter()
        if now - self._last[0] >= self._every:
            log.info("%s", self.line(step, now))

    def line(self, step: int, now: float) -> str:
        """The progress line at ``step`` (resets the interval)."""
        feed = self._feed
        t0, tokens0, waited0 = self._last
        span = max(1e-9, now - t0)
        self._last = (now, feed.counters.tokens, feed.counters.wait_after_first_s)
        total = self._total_steps()
        parts = [f"progress: step {step:,}" + (f" of {total:,}" if total else ""),
                 f"tokens {feed.counters.tokens:,}",
                 f"{run_summary.rate((feed.counters.tokens - tokens0) / span)} tokens/s (last "
                 f"{span:.{0 if span >= 10 else 1}f} s)"]
        if self._step_time:
            parts.append(f"stall {100 * min(1.0, (feed.counters.wait_after_first_s - waited0) / span):.1f}%")
        workers = feed.stats()["workers"] if feed.backend == "ray" else None
        if workers is not None:
            parts.append(f"workers {workers}")
        done = feed.counters.steps
        if total is not None and done and total > step:
            elapsed = now - (feed.counters.first_batch_time or now)
            eta = (total - step) * elapsed / max(1, done - 1) if done > 1 else None
            if eta is not None:
                parts.append(f"ETA {run_summary.duration(eta)}")
        return "  ".join(parts)

    def _total_steps(self) -> int | None:
        """The step the run ends at: ``--steps``, else the feed's iterator length (read once,
        at the first line: it plans the streams' units)."""
        if not self._length_known:
            self._length_known = True
            try:
                self._total = self._feed.iterator_length.steps
            except Exception:  # noqa: BLE001 -- only the ETA is lost
                self._total = None
            if self._steps is not None and self._total is not None:
                self._total = min(self._total, self._steps)
        return self._total

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _save(manager, step: int, feed) -> None:
    # Imported here: orbax takes about 0.7 s to import, before the first batch of every run
    # that saves nothing.
    from jax_side import checkpoint

    checkpoint.save_feed(manager, step, feed.get_state())


def prepare_environment(args) -> None:
    """Process-wide settings that must precede ``import ray``.

    A cluster this command starts itself (no --address, no $RAY_ADDRESS) listens on 127.0.0.1
    only, and a head given at a loopback address that listens there only is reached there
    (``ray_cluster.prepare_ray_environment``). Token authentication stays on, as Ray's default
    for a new local cluster; said explicitly (RAY_AUTH_MODE, unless set), Ray does not warn on
    every run that it turned it on.
    """
    address = getattr(args, "address", None) or os.environ.get("RAY_ADDRESS")
    prepare_ray_environment(address)
    if (address or "local") == "local":
        os.environ.setdefault("RAY_AUTH_MODE", "token")


def main(argv: list[str] | None = None, *, dev: bool = False,
         make_lab: Callable[..., Any] | None = None) -> int:
    """The ``ingest`` console script; with ``dev`` and ``make_lab``, ``ingest-dev``'s
    (``jax_side.dev``).

    SIGINT and SIGTERM end it at any point with one line and status ``128 + signal``
    (130 for Ctrl-C), after the cleanups (a local Ray cluster is stopped). With ``--json``,
    a run that fails (a refused command line included) prints one JSON object with the error
    as the last line of stdout.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    # Known before the command line is parsed: a refused one answers in JSON too.
    as_json = "--json" in argv and "bench" not in argv
    on_main_thread = threading.current_thread() is threading.main_thread()
    try:
        with exit_on_signals() if on_main_thread else contextlib.nullcontext():
            return _main(argv, dev=dev, as_json=as_json, make_lab=make_lab)
    except SystemExit as e:  # argparse: 0 for --help and --version, 2 for a refused line
        from ingest.cli import refused_command_line  # noqa: PLC0415

        if e.code == 2 and as_json and refused_command_line():
            run_summary.print_json_error(refused_command_line(), 2)
        raise
    except KeyboardInterrupt as e:
        code = e.exit_code if isinstance(e, Interrupted) else 128 + signal.SIGINT
        message = f"interrupted ({signal.Signals(code - 128).name}); stopped"
        print(f"ingest: {message}", file=sys.stderr)
        if as_json:
            run_summary.print_json_error(message, code)
        _leave_if_distributed(code)
        return code


def _main(argv: list[str], *, dev: bool, as_json: bool,
          make_lab: Callable[..., Any] | None) -> int:
    args = parse_args(argv, dev=dev)
    prepare_environment(args)
    from jax_side.host_join import ClusterJoinError  # noqa: PLC0415
    from jax_side.multihost import PeerError  # noqa: PLC0415
    logging.basicConfig(level=logging.WARNING, datefmt="%Y-%m-%d %H:%M:%S",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("ingest").setLevel(logging.INFO)

    def fail(message: str, code: int) -> int:
        print(f"ingest: error: {message}", file=sys.stderr)
        if as_json:
            run_summary.print_json_error(message, code)
        return code

    try:
        if args.command == "bench":
            return _bench(argv)
        if args.command == "materialize":
            from actors.materialize_job import materialize_command  # noqa: PLC0415

            return materialize_command(args)
        if args.hosts:
            from jax_side.local_hosts import launch_local_hosts  # noqa: PLC0415

            workers = config_from_args(args).runtime.workers
            return launch_local_hosts(argv, args, workers_per_host=workers)
        return run_command(args, make_lab=make_lab)
    except DevicesMismatchError as e:
        return fail(str(e), 2)
    except (ConfigError, BadInputError, StreamError, FileNotFoundError, ValueError,
            TimeoutError, PeerError, ClusterJoinError, ClusterUnreachableError) as e:
        # Input and config problems, a peer that left, a cluster that is gone: the message
        # names the fix; no traceback.
        code = fail(f"{_host()}{e}", 1)
        _leave_if_distributed(code)
        return code
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        if as_json:  # before the traceback, which goes to stderr
            run_summary.print_json_error(f"{_host()}{type(e).__name__}: {e}", 1)
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
