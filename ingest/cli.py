"""The ``ingest`` command line: its commands and flags, and their checks.

``ingest run [CONFIG]`` feeds a mesh of all local devices and reports throughput, waits and a
digest of every batch. This module only parses; running needs JAX and Ray, so the console
script is ``jax_side.run:main``, which parses with ``parse_args`` here and then runs. That keeps
``ingest`` free of any JAX, Ray or jax_side import.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["build_parser", "parse_args"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ingest", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="feed batches into a mesh of all local devices",
                       description="Run the feed. Without CONFIG, runs the built-in demo corpus "
                                   "(the Python standard library's source as Parquet shards).")
    r.add_argument("config", nargs="?", help="YAML config (default: the built-in demo)")
    r.add_argument("--steps", type=int, help="stop after this many steps in total (a resumed "
                   "run stops at the same step); default: until the data ends")
    r.add_argument("--workers", type=int, help="Ray worker actors (overrides config.workers)")
    r.add_argument("--backend", choices=("ray", "local"), default="ray",
                   help="ray: worker actors (default); local: in-process, no Ray")
    r.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else start "
                   "a local cluster on 127.0.0.1)")
    r.add_argument("--digest", action="store_true",
                   help="SHA-256 over every global batch (comparable across runs)")
    r.add_argument("--digest-log", metavar="FILE",
                   help="append one line 'STEP SHA256' per delivered step")
    r.add_argument("--json", action="store_true",
                   help="print the summary as one JSON object on the last line of stdout")
    r.add_argument("--checkpoint-dir", metavar="DIR", help="save the feed state here (orbax)")
    r.add_argument("--checkpoint-every", type=int, metavar="K",
                   help="save every K steps (needs --checkpoint-dir)")
    r.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir")
    r.add_argument("--step-time", type=float, default=0.0, metavar="SECONDS",
                   help="simulate a training step of this many seconds after each batch")
    r.add_argument("--kill-worker-every", type=float, metavar="SECONDS",
                   help="fault injection: SIGKILL a random Ray worker this often (the batches "
                        "must not change)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses and checks the command line; exits with status 2 naming every problem."""
    parser = build_parser()
    args = parser.parse_args(argv)
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
    if problems:
        parser.error("; ".join(problems))
    return args


if __name__ == "__main__":
    sys.exit("this module only parses; run the `ingest` command or `python -m jax_side.run`")
