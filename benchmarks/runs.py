"""Running the bench's measured programs, each in its own subprocess with a deadline.

``Runner`` runs one benchmark's programs, all on the same spec, environment and deadline, and
turns each program's JSON into a typed ``Section`` (or an error naming what failed: the harness
goes on). Every ``ingest run`` command line is built by ``ingest_run_command``.
"""

from __future__ import annotations

import os
import sys

from benchmarks import scaling
from benchmarks.corpus import BenchSpec
from benchmarks.machine import ROOT, child_env
from benchmarks.measure import RunResult, run_measured
from benchmarks.ratios import GRAINS, median_run, worker_run
from benchmarks.results_model import Scaling, Section, WorkerRun

__all__ = ["STEP_TIME_FACTOR", "Runner", "ingest_run_command", "log"]

STEP_TIME_FACTOR = 1.25  # the simulated training step, relative to our time per batch
# Per-subprocess deadlines: generous, so that a loaded machine is slow but never cut off.
TIMEOUT_S = {"full": 900.0, "quick": 120.0}
# The workers' runs (--no-warm-start), each between two measures of the tokenizer's limit: on a
# shared machine the speed of a core moves within minutes, and the ratios to the limit take
# the median of the runs' ratios.
WORKER_RUNS = {"full": 5, "quick": 1}
PEERS = ("grain", "grain_mp", "ray_data")
# Run again with tiktoken where the feed's backend is a faster one.
TIKTOKEN_PEERS = ("grain", "grain_mp")
# Runs of each grain pipeline on the feed's own backend, whose rate the grain target divides
# by: one grain run's rate spreads on a shared machine as the workers' runs do, and the run
# with the median rate counts.
GRAIN_RUNS = {"full": 3, "quick": 1}
# What the bench keeps of ``ingest run --json``'s figures (Section's typed fields are kept).
_OURS_DETAILS = ("steady_from_step", "wait_max_s", "warm_start_rows", "workers", "backend",
                 "streams", "padding_rows", "padding_tokens", "documents", "restarts",
                 "object_store_bytes_bound", "object_store_bytes_peak",
                 "rows_per_s_by_worker", "memory")
_STEP_DETAILS = ("steady_stall_fraction", "steady_from_step", "wait_s", "wait_max_s",
                 "memory", "warm_start_rows")


def log(msg: str) -> None:
    print(f"ingest bench: {msg}", file=sys.stderr, flush=True)


def ingest_run_command(run_config: str, *, steps: int | None, workers: int | None = None,
                       step_time: float | None = None, flags: tuple[str, ...] = ()
                       ) -> list[str]:
    """The argv of one ``ingest run`` of the bench (``--json``, no progress bar), with a
    simulated training step of ``step_time`` seconds where given (a flag of ``ingest-dev``,
    whose ``run`` is ``ingest run`` with the simulation flags)."""
    module = "jax_side.dev" if step_time else "jax_side.run"
    return [sys.executable, "-m", module, "run", run_config, "--json", "--no-progress",
            *(["--steps", str(steps)] if steps else []),
            *(["--workers", str(workers)] if workers else []),
            *(["--step-time", f"{step_time:.6f}"] if step_time else []), *flags]


def _section(result: RunResult, what: str) -> Section:
    """The program's JSON plus its wall time and memory, or an error naming what failed."""
    if not result.ok:
        log(f"{what} failed: {result.error()}")
        return Section(error=f"{what} {result.error()}", command=" ".join(result.command))
    out = dict(result.summary or {})
    out["wall_s"] = result.wall_s
    if result.memory is not None:
        out["memory"] = {k: v for k, v in result.memory.items() if k != "cpu_series"}
    return Section.from_json(out)


def _ours_section(out: Section, spec: BenchSpec, flags: tuple[str, ...] = ()) -> Section:
    """An ``ingest run``'s figures the bench keeps, with its rate counting startup and its
    times per batch."""
    if out.error is not None:
        return out
    sec = Section(steps=out.steps, tokens=out.tokens, tokens_per_s=out.tokens_per_s,
                  steady_tokens_per_s=out.steady_tokens_per_s, startup_s=out.startup_s,
                  stall_fraction=out.stall_fraction, wall_s=out.wall_s,
                  details={k: out.details[k] for k in _OURS_DETAILS if k in out.details})
    span = out.tokens / out.tokens_per_s if out.tokens and out.tokens_per_s else 0.0
    sec.tokens_per_s_with_startup = out.tokens / ((out.startup_s or 0.0) + span) if span else 0.0
    sec.seconds_per_batch = span / out.steps if out.steps else 0.0
    # The time the pipeline needs per batch once the chunks made before the first batch are
    # spent (HostFeed.stats: steady_*), which the training-step run's step is set from.
    sec.steady_seconds_per_batch = (out.tokens / out.steps / out.steady_tokens_per_s
                                    if out.tokens and out.steps and out.steady_tokens_per_s
                                    else sec.seconds_per_batch)
    sec.command = "ingest run CONFIG --json --no-progress" + (
        f" --steps {spec.steps}" if spec.steps else "") + "".join(f" {f}" for f in flags)
    return sec


class Runner:
    """Runs the measured programs of one benchmark, all with the same spec, env and deadline."""

    def __init__(self, spec: BenchSpec, tmp: str):
        self.spec = spec
        self.mode = "quick" if spec.quick else "full"
        self.timeout = TIMEOUT_S[self.mode]
        self.env = child_env()  # taken once: the sampler may add RAY_AUTH_MODE to this process
        self.spec_path = os.path.join(tmp, "spec.json")
        spec.save(self.spec_path)
        self.run_config = spec.write_run_config(os.path.join(tmp, "run.yaml"))

    def _measure(self, argv: list[str], what: str, *, timeout_s: float | None = None,
                 poll_object_store: bool = False) -> Section:
        result = run_measured(argv, timeout_s=timeout_s or self.timeout, env=self.env, cwd=ROOT,
                              poll_object_store=poll_object_store)
        return _section(result, what)

    def program(self, module: str, args: list[str], what: str) -> Section:
        return self._measure([sys.executable, "-m", module, *args], what)

    def limit(self, what: str, key: str) -> Section:
        log(f"limit: {key} on one core")
        return self.program("benchmarks.limit", [what, "--spec", self.spec_path],
                            f"limit {key}")

    def limits(self) -> dict[str, Section]:
        return {key: self.limit(what, key)
                for what, key in (("tokenizer", "tokenizer"), ("feed_backend", "feed_backend"),
                                  ("other", "other_backend"), ("parquet", "parquet"),
                                  ("produce", "produce"))}

    def ours(self, workers: int | None = None, *flags: str) -> Section:
        log(f"ours: ingest run, ray backend, {workers or self.spec.cpus} workers "
            f"{' '.join(flags)}")
        argv = ingest_run_command(self.run_config, steps=self.spec.steps, workers=workers,
                                  flags=flags)
        return _ours_section(self._measure(argv, "ingest run"), self.spec, flags)

    def worker_runs(self, before: float | None, after: float | None, first: Section
                    ) -> list[WorkerRun]:
        """The workers' run (``first``, between the limit measured ``before`` and right
        ``after`` it) and more of them, each followed by the limit again: each run's rates
        with the limit's measures on either side of it."""
        runs = [worker_run(first, before, after)]
        for i in range(1, WORKER_RUNS[self.mode]):
            ours = self.ours(None, "--no-warm-start")
            again = self.limit("tokenizer", f"tokenizer after run {i + 1} of ours")
            runs.append(worker_run(ours, runs[-1].limit_after, again.tokens_per_s))
        return runs

    def scaling(self, ours: Section, limit: Section) -> Scaling:
        """``ingest run --no-warm-start`` at each worker count of the sweep (``ours`` is the
        one at CPUs): the workers' own rates."""
        runs = []
        for w in scaling.sweep_points(self.spec.cpus):
            sec = ours if w == self.spec.cpus else self.ours(w, "--no-warm-start")
            keep = ({"error": sec.error} if sec.error is not None else
                    {"tokens_per_s": sec.tokens_per_s, "steady_tokens_per_s":
                     sec.steady_tokens_per_s, "startup_s": sec.startup_s})
            runs.append({"workers": w, **{k: v for k, v in keep.items() if v is not None}})
        return Scaling(cpus=self.spec.cpus, runs=runs,
                       single_core_limit_tokens_per_s=limit.tokens_per_s)

    def training_step(self, per_batch: float | None, *flags: str) -> Section:
        if not per_batch:
            return Section(error="needs our run's time per batch, and that run failed")
        step_time = STEP_TIME_FACTOR * per_batch
        log(f"training step: ingest run --step-time {step_time:.4f} {' '.join(flags)}")
        # The sleeps add up to steps x step_time: the deadline grows with them.
        deadline = self.timeout + 2 * (self.spec.steps or 2000 * self.spec.epochs) * step_time
        # Ray's object-store figure is polled here, not in the throughput runs: each poll has
        # the raylet query every worker, which slows a throughput run on few CPUs.
        argv = ingest_run_command(self.run_config, steps=self.spec.steps, step_time=step_time,
                                  flags=flags)
        out = self._measure(argv, "ingest run --step-time", timeout_s=deadline,
                            poll_object_store=True)
        return Section(error=out.error, command=out.command, steps=out.steps,
                       tokens=out.tokens, tokens_per_s=out.tokens_per_s,
                       stall_fraction=out.stall_fraction, startup_s=out.startup_s,
                       wall_s=out.wall_s,
                       details={**{k: out.details[k] for k in _STEP_DETAILS if k in out.details},
                                "step_time_s": step_time,
                                "step_time_factor": STEP_TIME_FACTOR,
                                "pipeline_seconds_per_batch": per_batch})

    def peers(self, fast_backend: bool) -> dict[str, Section]:
        """Each peer with the feed's tokenizer backend; where that is a faster one than
        tiktoken, grain again with tiktoken (``NAME_tiktoken``), except under ``--quick``.

        Each run of a grain pipeline on the feed's backend (``GRAINS``) is followed by the
        tokenizer's limit, as the workers' runs are: the grain target divides the two
        pipelines' ratios to the limit measured on either side of each run, not rates taken
        minutes apart on a machine whose speed moves (not under ``--quick``)."""
        out = {}
        runs = [(n, []) for n in PEERS]
        if fast_backend and not self.spec.quick:
            runs += [(f"{n}_tiktoken", ["--backend", "tiktoken"]) for n in TIKTOKEN_PEERS]
        limit_at: float | None = None  # the last measure of the limit, right before this run
        for key, extra in runs:
            name = key.removesuffix("_tiktoken")
            n = GRAIN_RUNS[self.mode] if key in GRAINS else 1
            paired = key in GRAINS and not self.spec.quick
            sections = []
            for i in range(n):
                if paired and limit_at is None:
                    limit_at = self.limit("tokenizer", f"tokenizer before {key}").tokens_per_s
                log(f"peer: {key}" + (f" (run {i + 1} of {n})" if n > 1 else ""))
                sec = self.program("benchmarks.peers", [name, "--spec", self.spec_path, *extra],
                                   f"peer {key}")
                if paired:
                    after = self.limit("tokenizer", f"tokenizer after {key} run {i + 1}")
                    sec.limit_before, sec.limit_after = limit_at, after.tokens_per_s
                    limit_at = after.tokens_per_s
                else:
                    limit_at = None
                sections.append(sec)
            out[key] = median_run(sections)
        return out

    def host_assembly(self, per_batch: float | None) -> Section:
        log("host assembly of one global batch")
        out = self.program("benchmarks.assembly", ["--spec", self.spec_path], "host assembly")
        us = out.details.get("assembly_us")
        if per_batch and us:
            out.details["fraction_of_our_batch_time"] = us * 1e-6 / per_batch
        return out
