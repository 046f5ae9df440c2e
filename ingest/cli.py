"""The ``ingest`` command line: its commands and flags, and their checks.

``ingest run [CONFIG]`` feeds a mesh of all local devices and reports throughput, waits and a
digest of every batch. This module parses the command line and builds its config
(``config_from_args``: the file or the demo, with ``--set`` and ``--workers``); running needs
JAX and Ray, so the console script is ``jax_side.run:main``, which parses here and then runs.
That keeps ``ingest`` free of any JAX, Ray or jax_side import.

The development and simulation flags of ``run`` (a simulated training step, fault injection,
several local JAX hosts) are not the user's: ``parse_args(argv, dev=True)`` adds them, for the
``ingest-dev`` console script (``jax_side.dev``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ingest.config import Config, config_keys, with_overrides
from ingest.config_checks import unknown_fields
from ingest.config_yaml import parse_override, read_yaml_fields
from ingest.errors import ConfigError

__all__ = ["build_parser", "config_from_args", "parse_args"]

# Progress lines without a terminal: often enough to show a job is alive in `kubectl logs`,
# rarely enough that a day-long job's log stays readable (about 3,000 lines a day).
LOG_EVERY_S = 30.0


_DEV_FLAGS = ("--step-time", "--kill-worker-every", "--hosts", "--devices-per-host")


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that keeps the message of the error it exits with (``error``), for
    the ``--json`` line of a refused command line."""

    failure: str | None = None

    def error(self, message: str):
        if not self.prog.startswith("ingest-dev") and any(
                f in message for f in _DEV_FLAGS):
            message += (f" ({', '.join(_DEV_FLAGS)} are development and simulation flags: "
                        f"`ingest-dev run ...` or `python -m jax_side.dev run ...` takes them)")
        _Parser.failure = message
        super().error(message)


def refused_command_line() -> str | None:
    """The message of the last command line ``parse_args`` refused (None if none was)."""
    return _Parser.failure


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ingest")
    except PackageNotFoundError:  # a source checkout that was never installed
        return "unknown (not installed: pip install -e .)"


def _add_job_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments ``run`` and ``materialize`` share: what to run and where."""
    p.add_argument("config", nargs="?", help="YAML config (default: the built-in demo)")
    p.add_argument("--workers", type=int, help="Ray worker actors (overrides the config's workers)")
    p.add_argument("--backend", choices=("ray", "local"), default="ray",
                   help="ray: worker actors (default); local: in-process, no Ray")
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else start "
                   "a local cluster on 127.0.0.1)")
    p.add_argument("--json", action="store_true",
                   help="print the summary as one JSON object on the last line of stdout")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (or periodic progress line) on stderr")
    p.add_argument("--log-every", type=float, default=LOG_EVERY_S, metavar="SECONDS",
                   help="where stderr is not a terminal (a log file, `ray job submit`, "
                   f"`kubectl logs`): one progress line this often (default {LOG_EVERY_S:.0f})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="set",
                   help="override the config field KEY with VALUE, read as YAML "
                   "(--set seq_len=512 --set num_epochs=null); repeatable")


def _add_dev_arguments(r: argparse.ArgumentParser) -> None:
    """``run``'s development and simulation flags (``ingest-dev run``)."""
    d = r.add_argument_group("development and simulation (ingest-dev only)")
    d.add_argument("--step-time", type=float, default=0.0, metavar="SECONDS",
                   help="simulate a training step of this many seconds after each batch")
    d.add_argument("--kill-worker-every", type=float, metavar="SECONDS",
                   help="fault injection: SIGKILL a random Ray worker this often (the batches "
                        "must not change)")
    d.add_argument("--hosts", type=int, metavar="N",
                   help="start N local JAX processes on 127.0.0.1 running this command; "
                        "process 0 prints one summary of the global batches")
    d.add_argument("--devices-per-host", type=int, default=4, metavar="D",
                   help="forced CPU devices of each --hosts process (default 4)")


def build_parser(*, dev: bool = False) -> argparse.ArgumentParser:
    """The ``ingest`` parser; with ``dev``, ``ingest-dev``'s (``run`` takes the development
    and simulation flags too)."""
    p = _Parser(prog="ingest-dev" if dev else "ingest", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="feed batches into a mesh of all local devices",
                       description="Run the feed. Without CONFIG, runs the built-in demo corpus "
                                   "(the Python standard library's source as Parquet shards).")
    _add_job_arguments(r)
    r.add_argument("--steps", type=int, help="stop after this many steps in total (a resumed "
                   "run stops at the same step); default: until the data ends")
    r.add_argument("--digest", action="store_true",
                   help="SHA-256 over every global batch (comparable across runs)")
    r.add_argument("--digest-log", metavar="FILE",
                   help="append one line 'STEP SHA256' per delivered step")
    r.add_argument("--checkpoint-dir", metavar="DIR", help="save the feed state here (orbax)")
    r.add_argument("--checkpoint-every", type=int, metavar="K",
                   help="save every K steps (needs --checkpoint-dir)")
    r.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir")
    r.add_argument("--allow-empty", action="store_true",
                   help="exit 0 even when a fresh run delivers no batch (every document "
                        "skipped, say); without it that is an error (exit 1)")
    r.add_argument("--no-warm-start", action="store_true",
                   help="the Ray workers make every chunk (by default this process makes the "
                        "first ones while Ray starts, and the workers take over where it is)")
    h = r.add_argument_group(
        "many JAX hosts", "On a cluster, run the same command on every host with --coordinator, "
        "--num-hosts and --host-id, or without them where jax.distributed.initialize() detects "
        "the cluster (Cloud TPU, Kubernetes, SLURM, Open MPI).")
    h.add_argument("--coordinator", metavar="ADDR",
                   help="host:port of process 0's JAX coordination service")
    h.add_argument("--num-hosts", type=int, metavar="N", help="JAX processes in the run")
    h.add_argument("--host-id", type=int, metavar="I", help="this process's index, 0..N-1")
    h.add_argument("--agreement-timeout", type=float, metavar="SECONDS",
                   help="how long a host waits for the others at the end-of-data agreement "
                        "before it fails naming those that never came (default 600)")
    if dev:
        _add_dev_arguments(r)
    else:
        # run_command reads them; the user's command line has none of them.
        r.set_defaults(step_time=0.0, kill_worker_every=None, hosts=None, devices_per_host=4)
    m = sub.add_parser(
        "materialize", help="run the streams of a finite config to their end and write their "
        "rows as Parquet segments (resumable)",
        description="Run every stream of CONFIG (finite num_epochs) to its end and write its "
                    "rows into DIR as Parquet segments, with a manifest. Rerunning the same "
                    "command continues an interrupted job: finished segments are kept. A source "
                    "{kind: materialized, paths: [DIR]} replays them.")
    _add_job_arguments(m)
    m.add_argument("--out", required=True, metavar="DIR", help="the directory to write (or to "
                   "continue)")
    m.add_argument("--segment-rows", type=int, default=4096, metavar="N",
                   help="rows per segment file (default 4096; a stream's last one is shorter)")
    b = sub.add_parser("bench", help="benchmark the feed against the tokenizer's limit, grain "
                       "and Ray Data", description="Benchmark: the single-core tokenizer limit, "
                       "`ingest run`, grain and Ray Data on one corpus (default: the built-in "
                       "demo), then `ingest run` at 1, 2, 4 ... workers (not with --quick); a table "
                       "on stderr, every figure in a JSON file, and a plot of tokens/s against "
                       "workers beside it (with matplotlib). Needs the source checkout "
                       "(benchmarks/).")
    b.add_argument("config", nargs="?", help="YAML config whose sources, tokenizer and batch "
                   "shape to use (default: the built-in demo)")
    b.add_argument("--corpus", choices=("demo", "tiny"), help="a built-in corpus instead of a "
                   "config: demo (the standard library's source, 18 KB documents) or tiny "
                   "(the same text cut into documents of at most 200 bytes); default: demo")
    b.add_argument("--tokenizer", metavar="SPEC", help="the tokenizer every pipeline uses "
                   "(gpt2, cl100k, ...; default: the config's); the peers run with the "
                   "feed's tokenizer_backend and, where that is not tiktoken, with tiktoken too")
    b.add_argument("--json", action="store_true",
                   help="also print the results as one JSON object on the last line of stdout")
    b.add_argument("--out", metavar="FILE", help="results file (default: "
                   "benchmarks/results.json, or benchmarks/results-quick.json with --quick)")
    b.add_argument("--quick", action="store_true",
                   help="smoke test: a slice of the corpus, a few steps and each peer "
                   "once (about 2 minutes)")
    b.add_argument("--epochs", type=int, metavar="N",
                   help="every pipeline reads the corpus N times (default: 3, so that the "
                   "steady rate is taken over many chunks of each stream; --quick: 1)")
    b.add_argument("--steps", type=int, metavar="N",
                   help="stop every pipeline after N steps (default: at the end of the "
                   "epochs; --quick: 40)")
    return p


def parse_args(argv: list[str] | None = None, *, dev: bool = False) -> argparse.Namespace:
    """Parses and checks the command line; exits with status 2 naming every problem.

    ``--set KEY=VALUE`` items become ``args.overrides``, ``{KEY: value read as YAML}`` in
    order (the last of a key wins); they are checked against the config when it is built.
    With ``dev``, ``ingest-dev``'s command line (see ``build_parser``).
    """
    _Parser.failure = None
    parser = build_parser(dev=dev)
    args = parser.parse_args(argv)
    if args.command in ("run", "materialize"):
        args.overrides = _overrides(parser, args.set)
        if not args.log_every > 0:
            parser.error(f"--log-every={args.log_every} must be positive")
    if args.command == "materialize":
        bad = [f"{flag}={v} must be positive" for flag, v in
               (("--segment-rows", args.segment_rows), ("--workers", args.workers))
               if v is not None and v <= 0]
        if bad:
            parser.error("; ".join(bad))
        return args
    if args.command == "bench":
        bad = [f"{flag}={v} must be positive" for flag, v in
               (("--steps", args.steps), ("--epochs", args.epochs)) if v is not None and v <= 0]
        if bad:
            parser.error("; ".join(bad))
        if args.config and args.corpus:
            parser.error(f"give a config or --corpus={args.corpus}, not both")
        return args
    problems = []
    if args.steps is not None and args.steps <= 0:
        problems.append(f"--steps={args.steps} must be positive")
    if args.workers is not None and args.workers <= 0:
        problems.append(f"--workers={args.workers} must be positive")
    if args.checkpoint_every is not None and (args.checkpoint_every <= 0 or not args.checkpoint_dir):
        problems.append("--checkpoint-every K needs K > 0 and --checkpoint-dir DIR")
    if args.step_time < 0:
        problems.append(f"--step-time={args.step_time} must be >= 0")
    if args.kill_worker_every is not None and (args.kill_worker_every <= 0
                                               or args.backend != "ray"):
        problems.append("--kill-worker-every SECONDS needs SECONDS > 0 and --backend ray")
    if args.resume and not args.checkpoint_dir:
        problems.append("--resume needs --checkpoint-dir DIR")
    joined = [args.coordinator is not None, args.num_hosts is not None, args.host_id is not None]
    if any(joined) and not all(joined):
        problems.append("--coordinator, --num-hosts and --host-id go together; give all three")
    elif all(joined) and not (args.num_hosts > 0 and 0 <= args.host_id < args.num_hosts):
        problems.append(f"--host-id={args.host_id} must be in 0..{args.num_hosts - 1} for "
                        f"--num-hosts={args.num_hosts}")
    if args.hosts is not None and (args.hosts <= 0 or any(joined)):
        problems.append("--hosts N needs N > 0 and starts its own processes: leave out "
                        "--coordinator, --num-hosts and --host-id")
    if args.agreement_timeout is not None and not args.agreement_timeout > 0:
        problems.append(f"--agreement-timeout={args.agreement_timeout} must be positive")
    if args.devices_per_host <= 0:
        problems.append(f"--devices-per-host={args.devices_per_host} must be positive")
    if problems:
        parser.error("; ".join(problems))
    return args


def _overrides(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    bad = []
    for item in items:
        try:
            key, value = parse_override(item)
        except ValueError as e:
            bad.append(str(e))
            continue
        out[key] = value
    if bad:
        parser.error("; ".join(bad))
    return out


def config_from_args(args: argparse.Namespace) -> Config:
    """The config of a command line: ``CONFIG`` (or the demo) with ``--workers`` and every
    ``--set KEY=VALUE`` applied, checked as a whole as the YAML file is.

    Raises:
      ConfigError: the file's problems (every one, as for the file alone).
      ValueError: problems that an override causes, one line naming each ``--set`` item.
    """
    overrides = dict(getattr(args, "overrides", None) or {})
    if args.workers is not None:
        overrides["workers"] = args.workers
    if args.config is None:
        from ingest.demo import demo_config  # noqa: PLC0415 (writes its corpus on first use)

        try:
            problems = unknown_fields(overrides, config_keys())
            if "sources" in overrides:
                problems.append("sources: the demo's corpus is built in; to read other sources, "
                                "give a CONFIG file")
            if problems:
                raise ConfigError(problems, where="the demo config")
            return demo_config().replace(**overrides) if overrides else demo_config()
        except ConfigError as e:
            raise _override_error(e, args) from e
    raw = with_overrides(read_yaml_fields(args.config), overrides)
    try:
        return Config.from_dict(raw, base_dir=os.path.dirname(os.path.abspath(args.config)))
    except ConfigError as e:
        if any(_mentions(p, key) for p in e.problems for key in overrides):
            raise _override_error(e, args) from e
        raise ConfigError(e.problems, where=args.config) from None


def _mentions(problem: str, key: str) -> bool:
    """Whether a config problem is about the field ``key`` (``seq_len=0 must ...``, ``unknown
    field 'x'; known fields: [...]``, ``... by num_streams=8``, ``sources[0] ...``)."""
    if problem.startswith("unknown field "):
        return problem.startswith(f"unknown field {key!r}")
    return problem.startswith((f"{key}=", f"{key}[", f"{key} ", f"{key}:")) or (
        f" {key}=" in problem)


def _override_error(e: ConfigError, args) -> ValueError:
    """One line for problems that ``--set`` or ``--workers`` cause: each named after the item
    that caused it; the file's own problems after them."""
    given = {k: f"--set {k}={v}" for k, v in _set_items(args).items()}
    if args.workers is not None:
        given["workers"] = f"--workers {args.workers}"
    parts = []
    for problem in e.problems:
        items = [item for key, item in given.items() if _mentions(problem, key)]
        parts.append(f"{', '.join(items)}: {problem}" if items
                     else f"{args.config or 'the demo config'}: {problem}")
    return ValueError("; ".join(parts))


def _set_items(args) -> dict[str, str]:
    """Each ``--set`` key with its value as typed (the last of a key)."""
    out = {}
    for item in getattr(args, "set", None) or []:
        key, _, text = item.partition("=")
        out[key.strip()] = text
    return out


if __name__ == "__main__":
    sys.exit("this module only parses; run the `ingest` command or `python -m jax_side.run`")
