"""``ingest run``: the feed on a mesh of all devices, with progress, summary and digest.

With several JAX processes (``--coordinator``/``--num-hosts``/``--host-id``, a cluster
environment, or ``--hosts N`` locally: ``jax_side.multihost``), the mesh spans every process's
devices, digests hash the gathered global batches, and process 0 prints one summary.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from ingest.cli import parse_args
from ingest.config import Config, ConfigError, load_config
from ingest.demo import demo_config
from ingest.digest import BatchDigest, step_digest
from ingest.errors import BadInputError, StreamError
from jax_side.ray_cluster import (
    ClusterUnreachableError,
    Interrupted,
    RayStarter,
    exit_on_signals,
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


def _summary_lines(s: dict[str, Any]) -> list[str]:
    lines = [
        f"steps {s['steps']}  tokens {s['tokens']:,}  tokens/s {s['tokens_per_s']:,.0f}  "
        + (f"startup {s['startup_s']:.2f} s" if s.get("startup_s") is not None
           else "startup - (no batch)")
        + f"  stall {100 * s['stall_fraction']:.1f}%"
        + (f"  (from step {s['steady_from_step']}: tokens/s {s['steady_tokens_per_s']:,.0f}, "
           f"stall {100 * s['steady_stall_fraction']:.1f}%)" if s.get("steady_from_step") else ""),
        f"backend {s['backend']}  workers {s['workers']}"
        + (f" ({s['pending_workers']} pending: no CPU for them)" if s.get("pending_workers")
           else "") + f"  restarts {s['restarts']}  "
        f"streams {s['streams']}  "
        f"padding rows {s['padding_rows']}  padding tokens {s['padding_tokens']:,}",
        (f"documents {s['documents']:,}" if s.get("documents") is not None
         else "documents - (a materialized source replays rows; it does not count documents)")
        + f"  truncated documents {s['truncated_documents']} "
        f"({s['truncated_tokens']:,} tokens)",
    ]
    if "dataset_size" in s:
        length = s["iterator_length"]
        steps = "endless" if length["steps"] is None else f"{length['steps']:,} steps"
        lines.append(f"dataset size {s['dataset_size']:,} documents per epoch  iterator length "
                     f"{steps} ({'exact: ' if length['exact'] else ''}{length['basis']})")
    if s.get("source_proportions"):
        lines.append("mixture: " + ", ".join(
            f"sources[{i}] {n:,} tokens ({100 * p:.1f}%)" for i, (n, p) in enumerate(
                zip(s["tokens_by_source"], s["source_proportions"], strict=True))))
    if s.get("dropped_rows"):
        lines.append(f"drop_remainder dropped {s['dropped_rows']} row(s) "
                     f"({s['dropped_tokens']:,} tokens): every row from the first partial step "
                     f"on")
    for reason, per_file in sorted(s["skipped_documents"].items()):
        total = sum(per_file.values())
        lines.append(f"skipped {total} document(s) as {reason}: "
                     + ", ".join(f"{p} ({n})" for p, n in sorted(per_file.items())))
    for path in s["skipped_files"]:
        lines.append(f"skipped unreadable file {path}")
    for path, n in sorted(s["skipped_rows_of_bad_files"].items()):
        lines.append(f"skipped {n} row(s) of unreadable data in {path}")
    if s.get("rows_per_s_by_worker"):
        lines.append("rows/s by worker: " + ", ".join(
            f"{w} {r:,.0f}" for w, r in sorted(s["rows_per_s_by_worker"].items())))
    if s.get("object_store_bytes_bound"):
        lines.append(f"object store held at most {s['object_store_bytes_peak'] / 2**20:.1f} MiB "
                     f"(bound {s['object_store_bytes_bound'] / 2**20:.1f} MiB)")
    if "digest" in s:
        lines.append(f"digest {s['digest']}")
    return lines


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
        opened = _open_feed(args, cfg, overrides, held)
    except BaseException:
        held.close()
        if ray_started is not None:
            ray_started.join()  # never exit with ray.init half done
        raise
    if opened is None:  # the batch does not fit the devices (the message is printed)
        if ray_started is not None:
            ray_started.join()
        return 2
    feed, manager = opened
    if ray_started is not None:
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
        if args.backend == "ray":
            import ray

            # Ray's log monitor prints to stdout asynchronously (worker deaths, say): disconnect
            # first, so that with --json the summary really is the last line.
            ray.shutdown()
    stats["startup_s"] = (first_batch_at - t_start) if first_batch_at else float("nan")
    if killed is not None:
        stats["workers_killed"] = killed
    stats["first_step"] = start_step
    stats["last_step"] = step
    if digest is not None:
        stats["digest"] = digest.hexdigest()
    return _report(args, stats, start_step)


def _open_feed(args, cfg: Config | None, overrides: dict[str, Any], held: contextlib.ExitStack):
    """Joins the JAX processes, builds the feed over all devices (on the demo when ``cfg`` is
    None), opens the checkpoint directory (locked by the lead process, in ``held``) and
    restores it with ``--resume``. Returns ``(feed, manager)`` (manager None without
    ``--checkpoint-dir``), or None when the batch does not divide over the devices (after
    printing why)."""
    import jax

    from jax_side import multihost
    from jax_side.feed import HostFeed
    from jax_side.sharding import batch_sharding

    # Before anything touches a JAX device, so that the device list is the global one.
    multihost.initialize(args.coordinator, args.num_hosts, args.host_id)
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
                    **timeouts)
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

    from jax_side import checkpoint, multihost

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

        killer = WorkerKiller(feed, args.kill_worker_every)
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
                checkpoint.save_feed(manager, step, feed.get_state())
                saved = step
            if bar is not None:
                _advance(bar, feed, step)
            if args.step_time:
                time.sleep(args.step_time)  # the simulated training step
            if args.steps is not None and step >= args.steps:
                break
        # The end of a run is a checkpoint too, so a finished run resumes where it stopped.
        if manager is not None and step > saved:
            checkpoint.save_feed(manager, step, feed.get_state())
    finally:
        if killer is not None:
            killer.stop()
        if bar is not None:
            bar.close()
        if digest_log is not None:
            digest_log.close()
    return step, first_batch_at, (killer.killed if killer is not None else None)


def _advance(bar, feed, step: int) -> None:
    """One step on the progress bar; the rate every 10 steps."""
    bar.update(1)
    if step % 10 == 0:
        span = time.perf_counter() - (feed.first_batch_time or time.perf_counter())
        bar.set_postfix_str(f"{feed.tokens / max(1e-9, span):,.0f} tok/s", refresh=False)


def _report(args, stats: dict[str, Any], start_step: int) -> int:
    """Prints the summary (the lead process, for every host) and returns the exit status:
    1 for a fresh run that delivered nothing, unless ``--allow-empty``."""
    import jax

    from jax_side import multihost

    if jax.process_count() > 1:
        stats = multihost.combine_stats(multihost.allgather_json(stats, "the run summaries"))
        if jax.process_index() != 0:
            return 0
    stats = _json_safe(stats)
    if not stats.get("documents_counted", True):
        stats["documents"] = None
    for line in _summary_lines(stats):
        print(line, file=sys.stderr)
    if args.json:
        print(json.dumps(stats, sort_keys=True, allow_nan=False))
    if stats["steps"] == 0 and start_step == 0:
        # A fresh run that delivered nothing: every document skipped, say, or no rows at all.
        if not getattr(args, "allow_empty", False):
            print(f"ingest: error: {_empty_run_message(stats)}", file=sys.stderr)
            return 1
        print(f"ingest: {_empty_run_message(stats)} (allowed by --allow-empty)",
              file=sys.stderr)
    return 0


def _json_safe(x: Any) -> Any:
    """``x`` with every NaN or infinite float replaced by None (JSON has no NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


def _empty_run_message(s: dict[str, Any]) -> str:
    """Why a run delivered no batch, from its summary."""
    skipped = sum(n for per_file in s["skipped_documents"].values() for n in per_file.values())
    reasons = ", ".join(sorted(s["skipped_documents"]))
    causes = []
    if skipped:
        causes.append(f"{skipped} document(s) were skipped ({reasons}; on_bad_document: skip)")
    if s["skipped_rows_of_bad_files"]:
        causes.append(f"{sum(s['skipped_rows_of_bad_files'].values())} row(s) of unreadable "
                      f"data were skipped (on_bad_file: skip)")
    if s["skipped_files"]:
        causes.append(f"{len(s['skipped_files'])} unreadable file(s) were skipped")
    if s.get("dropped_rows"):
        causes.append(f"drop_remainder dropped {s['dropped_rows']} row(s): no step was full")
    why = "; ".join(causes) if causes else "the sources gave no rows"
    return (f"the run delivered no batch: {why}. Fix the sources (or on_bad_document / "
            f"on_bad_file / drop_remainder), or pass --allow-empty if an empty run is expected")


def prepare_environment(args) -> None:
    """Process-wide settings that must precede ``import ray``.

    A cluster this command starts itself (no --address, no $RAY_ADDRESS) listens on 127.0.0.1
    only. Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when it is imported, so setting it later
    does nothing (its sockets then listen on every interface).
    """
    if (getattr(args, "address", None) or os.environ.get("RAY_ADDRESS") or "local") == "local":
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


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
    from jax_side.multihost import ClusterJoinError, PeerError  # noqa: PLC0415
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ingest").setLevel(logging.INFO)
    try:
        if args.command == "bench":
            return _bench(sys.argv[1:] if argv is None else list(argv))
        if args.command == "materialize":
            from jax_side.materialize import materialize_command  # noqa: PLC0415

            return materialize_command(args)
        if args.hosts:
            from jax_side.multihost import launch_local_hosts

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
    """A failed process of a multi-process run leaves at once (see ``multihost.leave``)."""
    if _host():
        from jax_side.multihost import leave

        if print_traceback:
            import traceback

            traceback.print_exc()
        leave(code)


if __name__ == "__main__":
    sys.exit(main())
