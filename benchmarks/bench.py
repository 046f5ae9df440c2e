"""``ingest bench``: our feed against the tokenizer's limit and against grain and Ray Data.

One invocation measures, on one corpus with one tokenizer, ``seq_len`` and batch, read
``--epochs`` times (default 3; ``benchmarks.corpus``), each in its own subprocess with a
deadline:

    1 limit        the configured tokenizer on one core with tiktoken (the feed's own
                   encode_docs; the reference of every ratio), the same on the feed's
                   tokenizer_backend where that is a faster exact one (toktok for cl100k,
                   tuetoken for GPT-2), the other backend (HF tokenizers on GPT-2's files),
                   Parquet reads, and our Stream.produce on one core with a cProfile split
                   of where it spends time;
                   the tokenizer again right after ours (2), to show whether the machine's
                   speed moved in between (``limit_drift``)
    2 ours         ``ingest run CONFIG --json``: Ray, one worker per CPU, global arrays on a
                   mesh of the local devices; process-tree RSS and CPU time sampled; again
                   with ``--no-warm-start``, five times (once with --quick), each run
                   followed by the tokenizer's limit again (the workers' own rate: the
                   ratios to the limit are the median of the runs' ratios, each to the mean
                   of the limit's measures on either side of it; the training step's time
                   per batch is set from the median steady rate)
    3 peers        grain (one process, and mp_prefetch with one process per CPU), Ray Data,
                   each on the feed's tokenizer backend, each grain pipeline three times (once
                   with --quick; the run with the median rate counts); grain again on
                   tiktoken where the feed's backend is a faster one
    4 assembly     host-side cost of one global batch against np.copy of its bytes
    5 step         ``ingest run --step-time S`` with S = 1.25 x our steady time per batch (over
                   the run's later part, see ``HostFeed.stats``): the stall;
                   Ray's object store polled (``ray memory --stats-only``'s figure)
    6 scaling      ``ingest run --workers W`` for W = 1, 2, 4, ... up to the CPUs (not with
                   --quick), and a plot of tokens/s against W (``benchmarks.scaling``)

Every figure and the ratios (ours / (CPUs x single-core limit), ours / best peer) go into a
JSON file, each ratio twice: with tokens/s from the first batch (the issue's measure) and with
the steady rate over the run's later part, where the chunks made before the first batch no
longer count; a table goes to stderr. A failed or timed-out measurement is recorded as an error
in its section; the harness goes on. Speed targets are reported (``meets_target``), never
asserted: timings belong here, not in tests.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

from benchmarks import scaling
from benchmarks.corpus import BenchSpec, make_spec
from benchmarks.measure import RunResult, machine_busy_cpu_s, run_measured

__all__ = ["bench_command", "format_table", "machine_facts", "package_versions", "run_bench"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_VERSION = 1
# Targets, reported and never asserted. With every runtime knob automatic: ours >= 0.85 x (CPUs
# x tiktoken's single-core rate) and >= 3 x the best grain pipeline on the same tokenizer; with
# the faster exact backend of cl100k: ours >= 1.3 x (CPUs x tiktoken's single-core rate).
TARGET_OF_LIMIT = 0.85
TARGET_OF_LIMIT_FAST_BACKEND = 1.3
TARGET_OVER_GRAIN = 3.0
STEP_TIME_FACTOR = 1.25  # the simulated training step, relative to our time per batch
# Other programs keeping this many CPUs busy at the start make the run provisional.
BUSY_WARNING = 0.5
BUSY_PROBE_S = 2.0
DRIFT_WARNING = 0.05  # the tokenizer's limit moving more than this between its two measures
# Per-subprocess deadlines. A full demo run takes ~20 s here; quick runs take a few seconds
# each plus startup. Generous, so that a loaded machine is slow but never cut off.
TIMEOUT_S = {"full": 900.0, "quick": 120.0}
# The workers' runs (--no-warm-start), each between two measures of the tokenizer's limit: on a
# shared machine the speed of a core moves by up to a fifth within minutes, and the ratios to
# the limit take the median of the runs' ratios.
WORKER_RUNS = {"full": 5, "quick": 1}
PEERS = ("grain", "grain_mp", "ray_data")
# Run again with tiktoken where the feed's backend is a faster one.
TIKTOKEN_PEERS = ("grain", "grain_mp")
# Runs of each grain pipeline on the feed's own backend, whose rate the grain target divides
# by: the run with the median rate counts. One grain run in one process made 5.8 - 8.7 M
# tokens/s on the demo on this machine within an hour, as the workers' runs spread too.
GRAIN_RUNS = {"full": 3, "quick": 1}
PEER_TITLES = {"grain": "grain, 1 process", "grain_mp": "grain mp_prefetch({cpus})",
               "ray_data": "Ray Data ({cpus} CPUs)",
               "grain_tiktoken": "grain, 1 process, tiktoken",
               "grain_mp_tiktoken": "grain mp_prefetch({cpus}), tiktoken"}
# The sections every results file has (the smoke test checks them).
SECTIONS = ("machine", "versions", "setting", "limit", "ours", "worker_runs", "peers",
            "host_assembly", "training_step", "scaling", "ratios")


def _log(msg: str) -> None:
    print(f"ingest bench: {msg}", file=sys.stderr, flush=True)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    # benchmarks/ is not an installed package: the measured programs import it from here.
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # Each run starts, and is timed with, its own local cluster on loopback. Ray
    # reads this variable when it is imported, so it must be in the environment from the start.
    env.pop("RAY_ADDRESS", None)
    env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    return env


def _section(result: RunResult, what: str) -> dict[str, Any]:
    """The program's JSON plus its wall time and memory, or an error naming what failed."""
    if not result.ok:
        _log(f"{what} failed: {result.error()}")
        return {"error": f"{what} {result.error()}", "command": " ".join(result.command)}
    out = dict(result.summary)
    out["wall_s"] = result.wall_s
    if result.memory is not None:
        out["memory"] = {k: v for k, v in result.memory.items() if k != "cpu_series"}
    return out


def busy_cpus(seconds: float = BUSY_PROBE_S) -> float:
    """CPUs the machine kept busy, on average, over the next ``seconds`` (this process sleeps):
    other programs running at the start. The load average would also count, for a minute
    after it ended, a benchmark run just before."""
    before = machine_busy_cpu_s()
    time.sleep(seconds)
    return (machine_busy_cpu_s() - before) / seconds


def machine_facts() -> dict[str, Any]:
    import psutil

    model = ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                         "")
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "cpu_siblings": _cpu_siblings(),
            "memory_bytes": psutil.virtual_memory().total, "platform": platform.platform(),
            "python": platform.python_version(), "load_average_start": os.getloadavg(),
            "busy_cpus_start": busy_cpus()}


def _cpu_siblings(root: str = "/sys/devices/system/cpu") -> list[list[int]]:
    """The CPUs that share a physical core (hyperthreads), one list per core, as the kernel
    reports them; [] where it does not."""
    cores = set()
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else ():
        path = os.path.join(root, name, "topology", "thread_siblings_list")
        if not (name.startswith("cpu") and name[3:].isdigit() and os.path.exists(path)):
            continue
        with open(path, encoding="ascii") as f:
            cpus = []
            for part in f.read().strip().split(","):
                a, _, b = part.partition("-")
                cpus.extend(range(int(a), int(b or a) + 1))
        cores.add(tuple(cpus))
    return [list(c) for c in sorted(cores)]


def package_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("ingest", "jax", "jaxlib", "grain", "ray", "pyarrow", "numpy", "tiktoken",
                 "tokenizers", "pandas"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _ours_section(out: dict[str, Any], spec: BenchSpec, flags: tuple[str, ...] = ()
                  ) -> dict[str, Any]:
    if "error" in out:
        return out
    keep = ("steps", "tokens", "tokens_per_s", "steady_tokens_per_s", "steady_from_step",
            "startup_s", "stall_fraction", "wait_max_s", "warm_start_rows",
            "workers", "backend", "streams", "padding_rows", "padding_tokens", "documents",
            "restarts", "object_store_bytes_bound", "object_store_bytes_peak",
            "rows_per_s_by_worker", "wall_s", "memory")
    out = {k: out[k] for k in keep if k in out}
    span = out["tokens"] / out["tokens_per_s"] if out.get("tokens_per_s") else 0.0
    out["tokens_per_s_with_startup"] = (out["tokens"] / (out["startup_s"] + span)
                                        if span else 0.0)
    out["seconds_per_batch"] = span / out["steps"] if out.get("steps") else 0.0
    # The time the pipeline needs per batch once the chunks made before the first batch are
    # spent (HostFeed.stats: steady_*), which the training-step run's step is set from.
    out["steady_seconds_per_batch"] = (
        out["tokens"] / out["steps"] / out["steady_tokens_per_s"]
        if out.get("steps") and out.get("steady_tokens_per_s") else out["seconds_per_batch"])
    out["command"] = "ingest run CONFIG --json --no-progress" + (
        f" --steps {spec.steps}" if spec.steps else "") + "".join(f" {f}" for f in flags)
    return out


def _worker_run(ours: dict[str, Any], before: float | None, after: float | None
                ) -> dict[str, Any]:
    """One workers' run's rates, with the tokenizer limit (tokens/s) measured before and
    after it (None where that measure failed)."""
    out = {"limit_before": before, "limit_after": after}
    if "error" in ours:
        return {**out, "error": ours["error"]}
    return {**out, **{k: ours[k] for k in ("tokens_per_s", "steady_tokens_per_s")
                      if k in ours}}


def _limit_means(runs: list[dict[str, Any]]) -> list[float] | None:
    """Each run's mean of the limit's measures on either side of it (``limit_before``,
    ``limit_after``; one may have failed); None where a run has neither."""
    limits = [[x for x in (r.get("limit_before"), r.get("limit_after")) if x] for r in runs]
    return [statistics.fmean(x) for x in limits] if all(limits) else None


def workers_rates(results: dict[str, Any]) -> dict[str, Any]:
    """The workers' rates and their ratios to the limit, over the workers' runs: each run's
    ratio divides by the mean of the limit's measures on either side of it, and every figure
    is the median over the runs. Without runs (a failed one), the --no-warm-start run's."""
    cpus = results["setting"]["cpus"]
    runs = [r for r in results.get("worker_runs", ()) if r.get("tokens_per_s")]
    if not runs:
        cold = results.get("ours_no_warm_start", {})
        if "tokens_per_s" not in cold:
            return {}
        runs = [_worker_run(cold, results["limit"].get("tokenizer", {}).get("tokens_per_s"),
                            None)]
    out: dict[str, Any] = {"runs": len(runs)}
    rates = [r["tokens_per_s"] for r in runs]
    steadies = [r.get("steady_tokens_per_s") or r["tokens_per_s"] for r in runs]
    out["tokens_per_s"] = statistics.median(rates)
    out["steady_tokens_per_s"] = statistics.median(steadies)
    means = _limit_means(runs)
    if means:
        out["ratios"] = [a / (cpus * m) for a, m in zip(rates, means, strict=True)]
        out["steady_ratios"] = [a / (cpus * m) for a, m in zip(steadies, means, strict=True)]
        out["ours_over_cpus_x_limit"] = statistics.median(out["ratios"])
        out["steady_ours_over_cpus_x_limit"] = statistics.median(out["steady_ratios"])
    return out


def _median_seconds_per_batch(results: dict[str, Any]) -> float | None:
    """The workers' steady time per batch at the median of their runs' steady rates (the
    runs make the same batches): the training step is set from it."""
    cold = results.get("ours_no_warm_start", {})
    rate = workers_rates(results).get("steady_tokens_per_s")
    if not rate or not cold.get("steps"):
        return None
    return cold["tokens"] / cold["steps"] / rate


def _late(peer: dict[str, Any]) -> bool:
    """Whether a peer's first batch came after more than half of its run's wall time."""
    return peer.get("startup_s", 0) > 0.5 * peer.get("wall_s", float("inf"))


def _ratios(results: dict[str, Any], cpus: int) -> dict[str, Any]:
    # Rates are the workers' (the run without warm start, whose every row they made); startup
    # and rates with startup are the default run's.
    default = results["ours"]
    cold = results.get("ours_no_warm_start", {})
    ours = cold if "tokens_per_s" in cold else default
    limit = results["limit"].get("tokenizer", {})
    produce = results["limit"].get("produce", {})
    feed_backend = results["limit"].get("feed_backend", {})
    # The faster backend's target is the one set for cl100k; GPT-2's faster backend, a third
    # faster than tiktoken alone, keeps the defaults' target.
    fast = ("tokens_per_s" in feed_backend
            and results["setting"]["tokenizer"] in ("cl100k", "cl100k_base"))
    out: dict[str, Any] = {"target_of_limit": (TARGET_OF_LIMIT_FAST_BACKEND if fast
                                               else TARGET_OF_LIMIT),
                           "target_over_grain": TARGET_OVER_GRAIN}
    if "tokens_per_s" not in ours or "tokens_per_s" not in default:
        out["error"] = "our run failed; no ratio"
        return out
    out["rates_from"] = "ours_no_warm_start" if ours is cold else "ours"
    # The workers' runs' medians (workers_rates); the default run's rates where those failed.
    runs = workers_rates(results) if ours is cold else {}
    rate = runs.get("tokens_per_s", ours["tokens_per_s"])
    steady = runs.get("steady_tokens_per_s",
                      ours.get("steady_tokens_per_s") or ours["tokens_per_s"])
    out["worker_runs"] = runs.get("runs", 1)
    # grain on the same tokenizer and backend as ours
    grains = [p for n, p in results["peers"].items()
              if n in GRAINS and p.get("tokens_per_s")]
    if grains:
        backend = feed_backend if "tokens_per_s" in feed_backend else limit
        # Where both pipelines' runs have the limit on either side, their ratios to it divide
        # (the machine's speed moves between the two sets of runs); else their rates.
        paired = "ratios" in runs and all("over_limit" in p for p in grains)
        if paired:
            best = max(grains, key=lambda p: p["over_limit"])
            out["grain_ratio_from"] = "ratios to the limit"
            out["ours_over_grain"] = cpus * runs["ours_over_cpus_x_limit"] / best["over_limit"]
            out["steady_ours_over_grain"] = (cpus * runs["steady_ours_over_cpus_x_limit"]
                                             / max(p["steady_over_limit"] for p in grains))
        else:
            best = max(grains, key=lambda p: p["tokens_per_s"])
            out["grain_ratio_from"] = "rates"
            out["ours_over_grain"] = rate / best["tokens_per_s"]
            # The same over each run's later part, where a grain run has one.
            out["steady_ours_over_grain"] = steady / max(
                p.get("steady_tokens_per_s") or p["tokens_per_s"] for p in grains)
        out["meets_grain_target"] = out["ours_over_grain"] >= TARGET_OVER_GRAIN
        out["meets_grain_target_steady"] = out["steady_ours_over_grain"] >= TARGET_OVER_GRAIN
        # The most ours / grain can be on these CPUs: every CPU running the tokenizer backend
        # alone (no feed makes more) over grain's rate. Grain in one process makes a share of
        # one core's tokenizer, so on few CPUs this caps the ratio, whatever the feed does.
        if paired and "tokens_per_s" in backend and "tokens_per_s" in limit:
            out["grain_ceiling"] = (cpus * backend["tokens_per_s"] / limit["tokens_per_s"]
                                    / best["over_limit"])
        elif "tokens_per_s" in backend:
            out["grain_ceiling"] = cpus * backend["tokens_per_s"] / best["tokens_per_s"]
    if "tokens_per_s" in limit:
        out["ours_over_cpus_x_limit"] = runs.get("ours_over_cpus_x_limit",
                                                 rate / (cpus * limit["tokens_per_s"]))
        out["meets_target"] = out["ours_over_cpus_x_limit"] >= out["target_of_limit"]
        out["steady_ours_over_cpus_x_limit"] = runs.get("steady_ours_over_cpus_x_limit",
                                                        steady / (cpus * limit["tokens_per_s"]))
        if "ratios" in runs:
            out["ours_over_cpus_x_limit_by_run"] = runs["ratios"]
            out["steady_ours_over_cpus_x_limit_by_run"] = runs["steady_ratios"]
        out["meets_target_steady"] = (out["steady_ours_over_cpus_x_limit"]
                                      >= out["target_of_limit"])
        out["ours_with_startup_over_cpus_x_limit"] = (
            default["tokens_per_s_with_startup"] / (cpus * limit["tokens_per_s"]))
        out["no_warm_start_with_startup_over_cpus_x_limit"] = (
            ours["tokens_per_s_with_startup"] / (cpus * limit["tokens_per_s"]))
    if "tokens_per_s" in limit:
        # The default run's rates: the first rows came from the host while Ray started.
        out["default_run_over_cpus_x_limit"] = (default["tokens_per_s"]
                                                / (cpus * limit["tokens_per_s"]))
    again = results["limit"].get("tokenizer_after_ours", {})
    if "tokens_per_s" in limit and "tokens_per_s" in again:
        # Above 1: the machine ran faster after ours than before it (other programs, a
        # virtual machine's neighbours); the ratios keep the first measure.
        out["limit_drift"] = again["tokens_per_s"] / limit["tokens_per_s"]
    if "tokens_per_s" in produce:
        # How much of the gap is the worker's own code path, how much the orchestration.
        out["produce_over_limit"] = produce["tokens_per_s"] / limit.get("tokens_per_s", 0) \
            if "tokens_per_s" in limit else None
        out["ours_over_cpus_x_produce"] = rate / (cpus * produce["tokens_per_s"])
        out["steady_ours_over_cpus_x_produce"] = steady / (cpus * produce["tokens_per_s"])
    ok = {n: p for n, p in results["peers"].items() if "tokens_per_s" in p}
    out["ours_over_each_peer"] = {n: rate / p["tokens_per_s"]
                                  for n, p in ok.items() if p["tokens_per_s"] > 0}
    out["ours_over_each_peer_with_startup"] = {
        n: default["tokens_per_s_with_startup"] / p["tokens_per_s_with_startup"]
        for n, p in ok.items() if p["tokens_per_s_with_startup"] > 0}
    # A rate from the first batch on is not a production rate when the batches came in a
    # burst (benchmarks.peers), faster than every CPU could tokenize, or after the run spent
    # most of its time before its first batch: the batches were made before the first one.
    # Such a peer is left out of the best peer by that measure, and named.
    fastest = max(limit.get("tokens_per_s", 0), feed_backend.get("tokens_per_s", 0))
    ceiling = cpus * fastest if fastest else float("inf")
    fair = {n: p for n, p in ok.items()
            if not p.get("bursty") and p["tokens_per_s"] <= ceiling and not _late(p)}
    out["peers_left_out"] = sorted(set(ok) - set(fair))
    if fair:
        best = max(fair, key=lambda n: fair[n]["tokens_per_s"])
        out.update(best_peer=best, ours_over_best_peer=out["ours_over_each_peer"][best])
        # The same over each run's later part (ours' chunks made before its first batch are
        # spent there); a peer without that figure keeps its rate from the first batch.
        rate = {n: p.get("steady_tokens_per_s") or p["tokens_per_s"] for n, p in fair.items()}
        best_s = max(rate, key=rate.get)
        out.update(steady_best_peer=best_s, steady_ours_over_best_peer=steady / rate[best_s])
    if ok:
        best_s = max(ok, key=lambda n: ok[n]["tokens_per_s_with_startup"])
        out.update(best_peer_with_startup=best_s,
                   ours_over_best_peer_with_startup=(
                       out["ours_over_each_peer_with_startup"][best_s]))
    return out


GRAINS = ("grain", "grain_mp")  # the grain pipelines on the feed's own backend


def _median_run(sections: list[dict[str, Any]]) -> dict[str, Any]:
    """Of a peer's runs, the one with the median rate (the lower of the middle two), with every
    run's rate in ``runs_tokens_per_s`` where there were several; a failed run only if all
    failed. Where every run that made batches has the limit measured on either side of it
    (``limit_before``, ``limit_after``), also each run's rate over the mean of the two
    (``over_limit_by_run``, steady too) and their medians (``over_limit``,
    ``steady_over_limit``)."""
    ok = sorted((s for s in sections if "tokens_per_s" in s), key=lambda s: s["tokens_per_s"])
    if not ok:
        return sections[-1]
    out = dict(ok[(len(ok) - 1) // 2])
    if len(sections) > 1:
        out["runs_tokens_per_s"] = [s.get("tokens_per_s") for s in sections]
    made = [s for s in sections if "tokens_per_s" in s]  # in the order they ran
    means = _limit_means(made)
    if means:
        out["over_limit_by_run"] = [s["tokens_per_s"] / m
                                    for s, m in zip(made, means, strict=True)]
        out["steady_over_limit_by_run"] = [
            (s.get("steady_tokens_per_s") or s["tokens_per_s"]) / m
            for s, m in zip(made, means, strict=True)]
        out["over_limit"] = statistics.median(out["over_limit_by_run"])
        out["steady_over_limit"] = statistics.median(out["steady_over_limit_by_run"])
    return out


class _Runner:
    """Runs the measured programs of one benchmark, all with the same spec, env and deadline."""

    def __init__(self, spec: BenchSpec, tmp: str):
        self.spec = spec
        self.timeout = TIMEOUT_S["quick" if spec.quick else "full"]
        self.env = child_env()  # taken once: the sampler may add RAY_AUTH_MODE to this process
        self.spec_path = os.path.join(tmp, "spec.json")
        spec.save(self.spec_path)
        steps = ["--steps", str(spec.steps)] if spec.steps else []
        self.run_args = ["run", spec.write_run_config(os.path.join(tmp, "run.yaml")), "--json",
                         "--no-progress", *steps]

    def program(self, module: str, args: list[str], what: str, *, timeout_s: float | None = None,
                poll_object_store: bool = False) -> dict[str, Any]:
        result = run_measured([sys.executable, "-m", module, *args],
                              timeout_s=timeout_s or self.timeout, env=self.env, cwd=ROOT,
                              poll_object_store=poll_object_store)
        return _section(result, what)

    def limit(self, what: str, key: str) -> dict[str, Any]:
        _log(f"limit: {key} on one core")
        return self.program("benchmarks.limit", [what, "--spec", self.spec_path],
                            f"limit {key}")

    def limits(self) -> dict[str, Any]:
        return {key: self.limit(what, key)
                for what, key in (("tokenizer", "tokenizer"), ("feed_backend", "feed_backend"),
                                  ("other", "other_backend"), ("parquet", "parquet"),
                                  ("produce", "produce"))}

    def ours(self, workers: int | None = None, *flags: str) -> dict[str, Any]:
        _log(f"ours: ingest run, ray backend, {workers or self.spec.cpus} workers "
             f"{' '.join(flags)}")
        extra = ["--workers", str(workers)] if workers else []
        out = self.program("jax_side.run", [*self.run_args, *extra, *flags], "ingest run")
        return _ours_section(out, self.spec, flags)

    def worker_runs(self, limit: dict[str, Any], first: dict[str, Any]) -> list[dict[str, Any]]:
        """The workers' run (``first``, between the limit and its measure right after) and
        more of them, each followed by the limit again: each run's rates with the limit's
        measures on either side of it."""
        runs = [_worker_run(first, limit.get("tokenizer", {}).get("tokens_per_s"),
                            limit.get("tokenizer_after_ours", {}).get("tokens_per_s"))]
        for i in range(1, WORKER_RUNS["quick" if self.spec.quick else "full"]):
            ours = self.ours(None, "--no-warm-start")
            after = self.limit("tokenizer", f"tokenizer after run {i + 1} of ours")
            runs.append(_worker_run(ours, runs[-1]["limit_after"], after.get("tokens_per_s")))
        return runs

    def scaling(self, ours: dict[str, Any], limit: dict[str, Any]) -> dict[str, Any]:
        """``ingest run --no-warm-start`` at each worker count of the sweep (``ours`` is the
        one at CPUs): the workers' own rates."""
        runs = []
        for w in scaling.sweep_points(self.spec.cpus):
            sec = ours if w == self.spec.cpus else self.ours(w, "--no-warm-start")
            keep = ("error",) if "error" in sec else ("tokens_per_s", "steady_tokens_per_s",
                                                      "startup_s")
            runs.append({"workers": w, **{k: sec[k] for k in keep if k in sec}})
        return {"cpus": self.spec.cpus, "runs": runs,
                "single_core_limit_tokens_per_s": limit.get("tokens_per_s")}

    def training_step(self, per_batch: float | None, *flags: str) -> dict[str, Any]:
        if not per_batch:
            return {"error": "needs our run's time per batch, and that run failed"}
        step_time = STEP_TIME_FACTOR * per_batch
        _log(f"training step: ingest run --step-time {step_time:.4f} {' '.join(flags)}")
        # The sleeps add up to steps x step_time: the deadline grows with them.
        deadline = self.timeout + 2 * (self.spec.steps or 2000 * self.spec.epochs) * step_time
        # Ray's object-store figure is polled here, not in the throughput runs: each poll has
        # the raylet query every worker, which cost ours about 15% of its rate on 2 CPUs.
        out = self.program("jax_side.dev",
                           [*self.run_args, "--step-time", f"{step_time:.6f}", *flags],
                           "ingest run --step-time", timeout_s=deadline, poll_object_store=True)
        out = {k: out[k] for k in ("error", "command", "steps", "tokens", "tokens_per_s",
                                   "stall_fraction", "steady_stall_fraction",
                                   "steady_from_step", "wait_s", "wait_max_s", "startup_s",
                                   "wall_s", "memory", "warm_start_rows") if k in out}
        out.update(step_time_s=step_time, step_time_factor=STEP_TIME_FACTOR,
                   pipeline_seconds_per_batch=per_batch)
        return out

    def peers(self, fast_backend: bool) -> dict[str, Any]:
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
            n = GRAIN_RUNS["quick" if self.spec.quick else "full"] if key in GRAINS else 1
            paired = key in GRAINS and not self.spec.quick
            sections = []
            for i in range(n):
                if paired and limit_at is None:
                    limit_at = self.limit("tokenizer", f"tokenizer before {key}").get(
                        "tokens_per_s")
                _log(f"peer: {key}" + (f" (run {i + 1} of {n})" if n > 1 else ""))
                sec = self.program("benchmarks.peers", [name, "--spec", self.spec_path, *extra],
                                   f"peer {key}")
                if paired:
                    after = self.limit("tokenizer", f"tokenizer after {key} run {i + 1}").get(
                        "tokens_per_s")
                    sec = {**sec, "limit_before": limit_at, "limit_after": after}
                    limit_at = after
                else:
                    limit_at = None
                sections.append(sec)
            out[key] = _median_run(sections)
        return out

    def host_assembly(self, per_batch: float | None) -> dict[str, Any]:
        _log("host assembly of one global batch")
        out = self.program("benchmarks.assembly", ["--spec", self.spec_path], "host assembly")
        if per_batch and "assembly_us" in out:
            out["fraction_of_our_batch_time"] = out["assembly_us"] * 1e-6 / per_batch
        return out


def run_bench(config: str | None, *, quick: bool, steps: int | None, command: str,
              tokenizer: str | None = None, epochs: int | None = None) -> dict[str, Any]:
    """Runs every measurement; returns the results (see ``SECTIONS``)."""
    spec = make_spec(config, quick=quick, steps=steps, tokenizer=tokenizer, epochs=epochs)
    resolved = _resolved(spec)
    results: dict[str, Any] = {
        "version": RESULTS_VERSION, "mode": "quick" if quick else "full", "command": command,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_facts(), "versions": package_versions(),
        "setting": {"config": config or "(built-in demo)", "files": list(spec.files),
                    "text_column": spec.text_column, "tokenizer": spec.tokenizer,
                    "tokenizer_backend": spec.tokenizer_backend,
                    "seq_len": spec.seq_len, "global_batch_size": spec.global_batch_size,
                    "num_streams": spec.num_streams, "cpus": spec.cpus,
                    "epochs": spec.epochs, "steps": spec.steps or "every epoch",
                    "runtime_knobs": resolved.runtime_choices(),
                    **{k: getattr(resolved, k) for k in ("packing", "chunk_rows", "prefetch",
                                                         "streams_per_call", "unit_rows")}},
    }
    with tempfile.TemporaryDirectory(prefix="ingest-bench-") as tmp:
        runner = _Runner(spec, tmp)
        results["limit"] = runner.limits()
        results["ours"] = runner.ours()
        # The workers alone from the first row: the pipeline's own rate, without the rows the
        # command's process makes while Ray starts (warm start).
        results["ours_no_warm_start"] = runner.ours(None, "--no-warm-start")
        # The tokenizer's limit again: how far the machine's speed moved since the first.
        results["limit"]["tokenizer_after_ours"] = runner.limit("tokenizer",
                                                                "tokenizer_after_ours")
        results["worker_runs"] = runner.worker_runs(results["limit"],
                                                    results["ours_no_warm_start"])
        per_batch = (_median_seconds_per_batch(results)
                     or results["ours"].get("steady_seconds_per_batch"))
        results["training_step"] = runner.training_step(per_batch)
        results["training_step_no_warm_start"] = runner.training_step(per_batch,
                                                                      "--no-warm-start")
        results["scaling"] = ({"skipped": "--quick runs no worker sweep"} if quick else
                              runner.scaling(results["ours_no_warm_start"],
                                             results["limit"]["tokenizer"]))
        results["peers"] = runner.peers("tokens_per_s" in results["limit"]["feed_backend"])
        results["host_assembly"] = runner.host_assembly(per_batch)
    results["machine"]["load_average_end"] = os.getloadavg()
    results["ratios"] = _ratios(results, spec.cpus)
    if spec.quick:  # a smoke test measures no target
        for key in ("meets_target", "meets_target_steady", "meets_grain_target",
                    "meets_grain_target_steady"):
            if key in results["ratios"]:
                results["ratios"][key] = None
    return results


def _resolved(spec: BenchSpec):
    """The run's config with its automatic knobs resolved as ``ingest run`` resolves them."""
    from ingest.config import Config  # noqa: PLC0415

    return Config.from_dict(spec.config)


# -- the table ------------------------------------------------------------------------------


def _tok(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 1e6:.2f} M" if x >= 1e5 else f"{x:,.0f}"


def _mib(x: float | None) -> str:
    return "-" if not x else f"{x / 2**20:,.0f}"


def _mem(section: dict[str, Any]) -> str:
    m = section.get("memory") or {}
    if not m:
        return "-"
    return (f"{_mib(m['host']['peak_bytes'])} / {_mib(m['workers']['peak_bytes'])} / "
            f"{_mib(m['total_peak_bytes'])}")


def _cpu_table(r: dict[str, Any]) -> str:
    """Where the CPU went during each run, and what other programs took meanwhile."""
    w = (34, 8, 8, 9, 11, 15)
    head = ("CPU seconds", "wall", "host", "workers", "Ray system", "other programs")
    lines = ["  ".join(h.ljust(n) for h, n in zip(head, w, strict=True))]
    runs = [("ours", r["ours"]), ("ours, --no-warm-start", r.get("ours_no_warm_start", {})),
            ("training step run", r["training_step"]), *r["peers"].items()]
    for name, sec in runs:
        m = sec.get("memory")
        if not m or "cpu_s" not in m:
            continue
        c = m["cpu_s"]
        cells = (name, f"{m['wall_s']:.1f}", f"{c['host']:.1f}", f"{c['workers']:.1f}",
                 f"{c['ray_system'] + c['ray_idle_workers']:.1f}",
                 f"{m['other_programs_cpu_s']:.1f}")
        lines.append("  ".join(x.ljust(n) for x, n in zip(cells, w, strict=True)))
    return "\n".join(lines)


def _against(x: float, target: float) -> str:
    """``x`` to 2 decimals, or to 3 where 2 would show a missed target as reached (0.849
    against 0.85)."""
    two = f"{x:.2f}"
    return f"{x:.3f}" if x < target <= float(two) else two


def _by_run(ratios: list[float] | None) -> str:
    """Each workers' run's ratio, where there were several (the figure before is their
    median)."""
    if not ratios or len(ratios) < 2:
        return ""
    return f"(median of {', '.join(f'{x:.2f}' for x in ratios)}) "


def format_table(r: dict[str, Any]) -> str:
    """The results as a plain-text table (the same one RESULTS.md shows)."""
    cpus = r["setting"]["cpus"]
    s = r["setting"]
    lines = [f"ingest bench ({r['mode']}): {len(s['files'])} file(s), tokenizer {s['tokenizer']}, "
             f"seq_len {s['seq_len']}, batch {s['global_batch_size']}, {cpus} CPUs, "
             f"epochs {s.get('epochs', 1)}, steps {s['steps']}"]
    busy = r["machine"].get("busy_cpus_start")
    load = r["machine"].get("load_average_start", (0,))[0]
    if busy is not None and busy > BUSY_WARNING:
        lines.append(f"WARNING: {busy:.1f} CPUs busy in the {BUSY_PROBE_S:.0f} s before the "
                     f"start: another program was running, so these figures are noisy "
                     f"(provisional)")
    elif busy is None and load > BUSY_WARNING:
        lines.append(f"WARNING: load average {load:.1f} at start: another program was busy, so "
                     f"these figures are noisy (provisional)")
    w = (34, 14, 12, 16, 10, 22)
    head = ("pipeline", "tokens/s", "steady", "tok/s w/ startup", "startup s",
            "peak RSS MiB h/w/total")
    lines += ["", "  ".join(h.ljust(n) for h, n in zip(head, w, strict=True)),
              "  ".join("-" * n for n in w)]

    def row(name: str, sec: dict[str, Any], note: str = "") -> None:
        if "error" in sec:
            lines.append(f"{name.ljust(w[0])}  error: {sec['error'][:160]}")
            return
        cells = (name, _tok(sec.get("tokens_per_s")), _tok(sec.get("steady_tokens_per_s")),
                 _tok(sec.get("tokens_per_s_with_startup")),
                 f"{sec['startup_s']:.2f}" if "startup_s" in sec else "-", _mem(sec))
        lines.append("  ".join(c.ljust(n) for c, n in zip(cells, w, strict=True))
                     + (f"  {note}" if note else ""))

    lim = r["limit"]
    tok = lim.get("tokenizer", {})
    row(f"tokenizer limit, 1 core ({tok.get('backend', '?')})", tok)
    if "tokens_per_s" in tok:
        lines.append(f"{'  x ' + str(cpus) + ' CPUs':<{w[0]}}  {_tok(cpus * tok['tokens_per_s'])}")
    again = lim.get("tokenizer_after_ours", {})
    if "tokens_per_s" in again and "tokens_per_s" in tok:
        drift = again["tokens_per_s"] / tok["tokens_per_s"] - 1
        lines.append(f"{'  again, right after ours':<{w[0]}}  {_tok(again['tokens_per_s']):<{w[1]}}"
                     f"  the machine's speed moved {drift:+.0%} in between"
                     + (": compare ratios with care" if abs(drift) > DRIFT_WARNING else ""))
    fb = lim.get("feed_backend", {})
    if "tokens_per_s" in fb or "error" in fb:
        row(f"feed's backend, 1 core ({fb.get('backend', '?')})", fb,
            f"{fb['tokens_per_s'] / tok['tokens_per_s']:.2f} x tiktoken"
            if "tokens_per_s" in fb and "tokens_per_s" in tok else "")
    other = lim.get("other_backend", {})
    if "skipped" in other:
        lines.append(f"{'other tokenizer backend':<{w[0]}}  skipped: {other['skipped']}")
    else:
        fast = other.get("encode_batch_fast", {})
        note = ""
        if "encode_batch" in other:
            note = f"encode_batch (with offsets): {_tok(other['encode_batch']['tokens_per_s'])}"
        row("HF tokenizers, 1 core", {**other, **({"tokens_per_s": fast["tokens_per_s"]}
                                                  if fast else {})}, note)
    prod = lim.get("produce", {})
    frac = (prod.get("profile") or {}).get("fractions") or {}
    row("our Stream.produce, 1 core", prod,
        "time: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in
                             sorted(frac.items(), key=lambda kv: -kv[1])) if frac else "")
    pq_ = lim.get("parquet", {})
    if "error" in pq_:
        row("Parquet read, 1 core", pq_)
    else:
        lines.append(f"{'Parquet read, 1 core':<{w[0]}}  {pq_['bytes_per_s'] / 1e6:,.0f} MB/s of "
                     f"text, {pq_['documents_per_s']:,.0f} docs/s (into Python str; Arrow only: "
                     f"{pq_['arrow']['bytes_per_s'] / 1e6:,.0f} MB/s)")
    lines.append("")
    ours = r["ours"]
    store = ((r["training_step"].get("memory") or {}).get("object_store") or {})
    note = ""
    if "stall_fraction" in ours:
        note = (f"stall {100 * ours['stall_fraction']:.0f}% (no step); object store: feed's "
                f"peak {_mib(ours.get('object_store_bytes_peak'))} MiB (bound "
                f"{_mib(ours.get('object_store_bytes_bound'))}), Ray's used peak "
                f"{_mib(store.get('used_peak_bytes'))} MiB (step run)")
    row(f"ours: ray, {cpus} workers", ours, note + (
        f"; warm start: {ours['warm_start_rows']:,} rows made by the host"
        if ours.get("warm_start_rows") else ""))
    if "ours_no_warm_start" in r:
        row("  the same, --no-warm-start", r["ours_no_warm_start"])
    runs = [x for x in r.get("worker_runs", ()) if x.get("tokens_per_s")]
    if len(runs) > 1:
        lines.append(f"{'':<{w[0]}}  {len(runs)} runs of it, each between two measures of the "
                     f"limit: " + ", ".join(_tok(x["tokens_per_s"]) for x in runs)
                     + " tokens/s; the ratios below take the median")
    mem = ours.get("memory") or {}
    if (mem.get("workers") or {}).get("max_process_bytes"):
        wk, host = mem["workers"], mem.get("host") or {}
        lines.append(f"{'':<{w[0]}}  one worker's peak RSS {_mib(wk['max_process_bytes'])} MiB, "
                     f"{_mib(wk.get('max_process_own_bytes'))} MiB without shared-memory pages "
                     f"(Ray's object store, mapped in; the host: "
                     f"{_mib(host.get('max_process_own_bytes'))} of "
                     f"{_mib(host.get('max_process_bytes'))} MiB)")
    for name, sec in r["peers"].items():
        note = ""
        if name in r["ratios"].get("peers_left_out", ()):
            why = (f"batches came in bursts (median gap {sec['median_gap_s'] * 1e3:.1f} ms, "
                   f"mean {sec['mean_gap_s'] * 1e3:.1f} ms)" if sec.get("bursty") else
                   f"first batch after {sec['startup_s']:.0f} of its {sec['wall_s']:.0f} s"
                   if _late(sec) else f"faster than {cpus} CPUs can tokenize")
            note = f"{why}: its tokens/s from the first batch counts batches made before it"
        elif sec.get("runs_tokens_per_s"):
            rates = sec["runs_tokens_per_s"]
            note = (f"the median of {len(rates)} runs: "
                    + ", ".join(_tok(x) if x else "failed" for x in rates)
                    + ("; over the limit on either side: "
                       + ", ".join(f"{x:.2f}" for x in sec["over_limit_by_run"])
                       if sec.get("over_limit_by_run") else ""))
        row(PEER_TITLES[name].format(cpus=cpus), sec, note)
    lines += ["", _cpu_table(r)]
    lines.append("")
    a = r["host_assembly"]
    if "error" in a:
        lines.append(f"host assembly: error: {a['error'][:160]}")
    else:
        frac_batch = a.get("fraction_of_our_batch_time")
        lines.append(
            f"host assembly of one batch ({a['batch_bytes'] / 2**20:.2f} MiB, {a['devices']} "
            f"device(s)): {a['assembly_us'] / 1e3:.3f} ms = {a['assembly_over_np_copy']:.0f} x "
            f"np.copy ({a['np_copy_us'] / 1e3:.3f} ms); row copies {a['row_copy_us'] / 1e3:.3f} "
            f"ms, 6 device arrays {a['make_array_us'] / 1e3:.3f} ms"
            + (f"; {100 * frac_batch:.1f}% of our time per batch" if frac_batch else ""))
        if a.get("sweep"):
            lines.append("  larger batches (synthetic chunks): " + ", ".join(
                f"{x['global_batch_size']}x{x['seq_len']} {x['assembly_over_np_copy']:.1f} x"
                for x in a["sweep"]) + " np.copy")
    for key, how in (("training_step", ""), ("training_step_no_warm_start",
                                             ", --no-warm-start")):
        st = r.get(key)
        if st is None:
            continue
        if "error" in st:
            lines.append(f"training step{how}: error: {st['error'][:160]}")
            continue
        lines.append(f"training step of {st['step_time_s'] * 1e3:.2f} ms ({st['step_time_factor']}"
                     f" x our steady {st['pipeline_seconds_per_batch'] * 1e3:.2f} ms per batch"
                     f"{how}): stall {100 * st['stall_fraction']:.1f}%"
                     + (f" (from step {st['steady_from_step']}: "
                        f"{100 * st['steady_stall_fraction']:.2f}%)"
                        if st.get("steady_from_step") else "")
                     + (f"; {st['warm_start_rows']:,} rows from the host while Ray started"
                        if st.get("warm_start_rows") else ""))
    sc = r.get("scaling", {})
    if "runs" in sc:
        lines.append("tokens/s by workers: " + ", ".join(
            f"{x['workers']}: error" if "error" in x else
            f"{x['workers']}: {_tok(x.get('tokens_per_s'))} (steady "
            f"{_tok(x.get('steady_tokens_per_s'))})" for x in sc["runs"])
            + (f"; plot {os.path.relpath(sc['plot'], ROOT)}" if sc.get("plot") else
               f"; {sc['plot_skipped']}" if sc.get("plot_skipped") else ""))
    ra = r["ratios"]
    if ra.get("rates_from") == "ours_no_warm_start":
        lines.append("ratios of rates: the workers' run (--no-warm-start); startup and rates "
                     "with startup: the default run")
    if "ours_over_cpus_x_limit" in ra:
        lines.append(f"ours / ({cpus} x single-core limit) = "
                     f"{_against(ra['ours_over_cpus_x_limit'], ra['target_of_limit'])} "
                     + _by_run(ra.get("ours_over_cpus_x_limit_by_run"))
                     + f"(target {ra['target_of_limit']}: "
                     + ("not judged: --quick runs fewer steps than the chunks made before "
                        "the first batch hold" if r["mode"] == "quick" else
                        f"{'met' if ra['meets_target'] else 'missed'}") + ")"
                     + (f"; our produce / limit = {ra['produce_over_limit']:.2f}, ours / ({cpus} x"
                        f" our produce) = {ra['ours_over_cpus_x_produce']:.2f}"
                        if ra.get("produce_over_limit") else ""))
    if "steady_ours_over_cpus_x_limit" in ra and r["mode"] != "quick":
        lines.append(f"steady: ours / ({cpus} x single-core limit) = "
                     f"{_against(ra['steady_ours_over_cpus_x_limit'], ra['target_of_limit'])} "
                     + _by_run(ra.get("steady_ours_over_cpus_x_limit_by_run"))
                     + f"(target {ra['target_of_limit']}: "
                     f"{'met' if ra['meets_target_steady'] else 'missed'}); ours / ({cpus} x "
                     f"our produce) = {ra.get('steady_ours_over_cpus_x_produce', 0):.2f}")
    if "default_run_over_cpus_x_limit" in ra and r["mode"] != "quick":
        lines.append(f"the default run from its first batch: ours / ({cpus} x single-core "
                     f"limit) = {ra['default_run_over_cpus_x_limit']:.2f} (its first rows come "
                     f"from one thread of the host while Ray starts, at low priority after the "
                     f"first batch)")
    if "ours_with_startup_over_cpus_x_limit" in ra:
        lines.append(f"counting startup: ours / ({cpus} x single-core limit) = "
                     f"{ra['ours_with_startup_over_cpus_x_limit']:.2f}"
                     + (f" (--no-warm-start: "
                        f"{ra['no_warm_start_with_startup_over_cpus_x_limit']:.2f})"
                        if "no_warm_start_with_startup_over_cpus_x_limit" in ra else ""))
    if "ours_over_grain" in ra:
        target = ra["target_over_grain"]
        lines.append(f"ours / best grain on the same tokenizer = "
                     f"{_against(ra['ours_over_grain'], target)}"
                     + (f"; steady {_against(ra['steady_ours_over_grain'], target)}"
                        if "steady_ours_over_grain" in ra else "")
                     + f" (target {ra['target_over_grain']}: "
                     + ("not judged: --quick" if r["mode"] == "quick" else
                        f"{'met' if ra['meets_grain_target'] else 'missed'}"
                        + (f", steady {'met' if ra['meets_grain_target_steady'] else 'missed'}"
                           if "meets_grain_target_steady" in ra else "")) + ")"
                     + (f"; at most {ra['grain_ceiling']:.2f} here ({cpus} x the tokenizer "
                        f"backend alone / grain)" if "grain_ceiling" in ra else "")
                     + ("; each pipeline's median ratio to the limit measured on either side "
                        "of its runs" if ra.get("grain_ratio_from") == "ratios to the limit"
                        else ""))
    if "best_peer" in ra:
        lines.append(f"ours / best peer = {ra['ours_over_best_peer']:.2f} ({ra['best_peer']}, "
                     f"tokens/s from the first batch"
                     + (f"; left out, no production rate: {', '.join(ra['peers_left_out'])}"
                        if ra["peers_left_out"] else "") + f"); steady: "
                     f"{ra['steady_ours_over_best_peer']:.2f} ({ra['steady_best_peer']})")
    if "best_peer_with_startup" in ra:
        lines.append(f"ours / best peer counting startup = "
                     f"{ra['ours_over_best_peer_with_startup']:.2f} "
                     f"({ra['best_peer_with_startup']})")
    return "\n".join(lines)


def bench_command(args) -> int:
    """The ``ingest bench`` command: runs, prints the table, writes the JSON."""
    corpus = getattr(args, "corpus", None)
    tokenizer = getattr(args, "tokenizer", None)
    parts = ["ingest", "bench"] + ([args.config] if args.config else []) + (
        [f"--corpus={corpus}"] if corpus else []) + (
        [f"--tokenizer={tokenizer}"] if tokenizer else []) + (
        ["--quick"] if args.quick else []) + (
        ["--epochs", str(args.epochs)] if args.epochs else []) + (
        ["--steps", str(args.steps)] if args.steps else [])
    default = "results-quick" if args.quick else "results"
    if corpus == "tiny":
        default += "-tiny"
    if tokenizer:
        default += f"-{os.path.basename(tokenizer).split('.')[0]}"
    out = args.out or os.path.join(HERE, default + ".json")
    config = args.config
    if corpus == "tiny":
        from benchmarks.tiny_corpus import write_tiny_corpus  # noqa: PLC0415

        config = write_tiny_corpus()
    results = run_bench(config, quick=args.quick, steps=args.steps, command=" ".join(parts),
                        tokenizer=tokenizer, epochs=args.epochs)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    sc = results["scaling"]
    if "runs" in sc:
        png = os.path.splitext(out)[0] + "-workers.png"
        why = scaling.plot(sc, png, title=f"ingest run, {results['setting']['config']}, "
                                          f"{sc['cpus']} CPUs")
        sc.update({"plot_skipped": why} if why else {"plot": png})
    with open(out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, sort_keys=True)
        f.write("\n")
    print(format_table(results), file=sys.stderr)
    print(f"ingest bench: results in {out}", file=sys.stderr)
    if args.json:
        print(json.dumps(results, sort_keys=True))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.bench [CONFIG] [--quick] ...``, which ``ingest bench`` runs."""
    from ingest.cli import parse_args  # noqa: PLC0415
    from ingest.config import ConfigError  # noqa: PLC0415
    from ingest.errors import BadInputError  # noqa: PLC0415
    from jax_side.run import prepare_environment  # noqa: PLC0415

    args = parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    prepare_environment(args)
    try:
        return bench_command(args)
    except (ConfigError, BadInputError, FileNotFoundError, ValueError) as e:
        print(f"ingest: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
