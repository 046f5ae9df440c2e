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

The parts: ``runs`` runs the measured programs, ``ratios`` judges them, ``report`` prints the
table, ``results_model`` is the typed results and their JSON.
"""


from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile

from benchmarks import scaling
from benchmarks.corpus import BenchSpec, make_spec
from benchmarks.machine import machine_facts, package_versions
from benchmarks.ratios import compute_ratios, median_seconds_per_batch
from benchmarks.report import format_table
from benchmarks.results_model import BenchResults, Limits, Machine, Scaling, Setting
from benchmarks.runs import Runner

__all__ = ["SECTIONS", "bench_command", "run_bench"]

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_VERSION = 1
# The sections every results file has (the smoke test checks them).
SECTIONS = ("machine", "versions", "setting", "limit", "ours", "worker_runs", "peers",
            "host_assembly", "training_step", "scaling", "ratios")


def _setting(config: str | None, spec: BenchSpec) -> Setting:
    """What is measured, with the run's automatic knobs resolved as ``ingest run`` resolves
    them."""
    from ingest.config import Config  # noqa: PLC0415
    from ingest.runtime import resolve_runtime  # noqa: PLC0415

    resolved = Config.from_dict(spec.config)
    runtime = resolve_runtime(resolved)
    return Setting(config=config or "(built-in demo)", files=list(spec.files),
                   tokenizer=spec.tokenizer, tokenizer_backend=spec.tokenizer_backend,
                   seq_len=spec.seq_len, global_batch_size=spec.global_batch_size,
                   cpus=spec.cpus, epochs=spec.epochs, steps=spec.steps or "every epoch",
                   details={"text_column": spec.text_column, "num_streams": spec.num_streams,
                            "runtime_knobs": runtime.choices(),
                            "packing": resolved.packing, "unit_rows": resolved.unit_rows,
                            **{k: getattr(runtime, k) for k in
                               ("chunk_rows", "prefetch", "streams_per_call")}})


def run_bench(config: str | None, *, quick: bool, steps: int | None, command: str,
              tokenizer: str | None = None, epochs: int | None = None) -> BenchResults:
    """Runs every measurement; returns the results (see ``SECTIONS``)."""
    spec = make_spec(config, quick=quick, steps=steps, tokenizer=tokenizer, epochs=epochs)
    created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    machine = Machine.from_json(machine_facts())
    setting = _setting(config, spec)
    with tempfile.TemporaryDirectory(prefix="ingest-bench-") as tmp:
        runner = Runner(spec, tmp)
        limit = Limits(**runner.limits())
        results = BenchResults(version=RESULTS_VERSION, mode="quick" if quick else "full",
                               command=command, created=created, machine=machine,
                               versions=package_versions(), setting=setting, limit=limit,
                               ours=runner.ours())
        # The workers alone from the first row: the pipeline's own rate, without the rows the
        # command's process makes while Ray starts (warm start).
        cold = results.ours_no_warm_start = runner.ours(None, "--no-warm-start")
        # The tokenizer's limit again: how far the machine's speed moved since the first.
        limit.tokenizer_after_ours = runner.limit("tokenizer", "tokenizer_after_ours")
        results.worker_runs = runner.worker_runs(limit.tokenizer.tokens_per_s,
                                                 limit.tokenizer_after_ours.tokens_per_s, cold)
        per_batch = median_seconds_per_batch(results) or results.ours.steady_seconds_per_batch
        results.training_step = runner.training_step(per_batch)
        results.training_step_no_warm_start = runner.training_step(per_batch, "--no-warm-start")
        results.scaling = (Scaling(skipped="--quick runs no worker sweep") if quick else
                           runner.scaling(cold, limit.tokenizer))
        results.peers = runner.peers(limit.feed_backend.measured)
        results.host_assembly = runner.host_assembly(per_batch)
    machine.load_average_end = list(os.getloadavg())
    results.ratios = compute_ratios(results)
    return results


def _default_out(args) -> str:
    """benchmarks/results[-quick][-tiny][-TOKENIZER].json."""
    name = "results-quick" if args.quick else "results"
    if getattr(args, "corpus", None) == "tiny":
        name += "-tiny"
    if getattr(args, "tokenizer", None):
        name += f"-{os.path.basename(args.tokenizer).split('.')[0]}"
    return os.path.join(HERE, name + ".json")


def _command_line(args) -> str:
    """The ``ingest bench`` command that reproduces this run, for the results file."""
    corpus, tokenizer = getattr(args, "corpus", None), getattr(args, "tokenizer", None)
    parts = ["ingest", "bench"] + ([args.config] if args.config else []) + (
        [f"--corpus={corpus}"] if corpus else []) + (
        [f"--tokenizer={tokenizer}"] if tokenizer else []) + (
        ["--quick"] if args.quick else []) + (
        ["--epochs", str(args.epochs)] if args.epochs else []) + (
        ["--steps", str(args.steps)] if args.steps else [])
    return " ".join(parts)


def bench_command(args) -> int:
    """The ``ingest bench`` command: runs, prints the table, writes the JSON."""
    out = args.out or _default_out(args)
    config = args.config
    if getattr(args, "corpus", None) == "tiny":
        from benchmarks.tiny_corpus import write_tiny_corpus  # noqa: PLC0415

        config = write_tiny_corpus()
    results = run_bench(config, quick=args.quick, steps=args.steps, command=_command_line(args),
                        tokenizer=getattr(args, "tokenizer", None), epochs=args.epochs)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    sc = results.scaling
    if sc is not None and sc.runs is not None:
        png = os.path.splitext(out)[0] + "-workers.png"
        why = scaling.plot(sc.to_json(), png, title=f"ingest run, {results.setting.config}, "
                                                    f"{sc.cpus} CPUs")
        sc.plot_skipped, sc.plot = (why, None) if why else (None, png)
    data = results.to_json()
    with open(out, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    print(format_table(results), file=sys.stderr)
    print(f"ingest bench: results in {out}", file=sys.stderr)
    if args.json:
        print(json.dumps(data, sort_keys=True))
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
