"""The benchmark harness: `ingest bench --quick` end to end, and the Ray Data peer's packing.

The smoke test runs the real command as a subprocess (it starts its own Ray clusters, grain
processes and JAX processes) and checks that the results file has every section with positive
figures. It asserts no speed: speed targets live in benchmarks/, never in timed tests.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ingest.stream.chunk_format import FIELDS, fields_of
from ingest.stream.pack import concat_rows
from ingest.stream.shift import shift_rows

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # benchmarks/ is not an installed package

from benchmarks.bench import SECTIONS  # noqa: E402
from benchmarks.limit import produce_split  # noqa: E402
from benchmarks.peers import pack_rows  # noqa: E402
from benchmarks.results_model import BenchResults, Section, WorkerRun  # noqa: E402

# `--quick` takes about a minute on a quiet 2-CPU machine; the deadline allows for a shared one.
TIMEOUT_S = 600


def _positive(section: dict, *keys: str) -> None:
    for key in keys:
        value = section
        for part in key.split("."):
            value = value[part]
        assert isinstance(value, int | float) and value > 0, f"{key}={value!r} is not positive"


@pytest.mark.slow
def test_quick_bench_writes_every_section_with_positive_figures(tmp_path):
    out = tmp_path / "results.json"
    cmd = [sys.executable, "-m", "jax_side.run", "bench", "--quick", "--json", "--out", str(out)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} ran past {TIMEOUT_S} s; stderr so far:\n{e.stderr}")
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}"
    results = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == results
    for name in SECTIONS:
        assert name in results, f"section {name!r} missing"
    failed = {k: v["error"] for k, v in [*results["limit"].items(), *results["peers"].items(),
                                         ("ours", results["ours"]),
                                         ("host_assembly", results["host_assembly"]),
                                         ("training_step", results["training_step"])]
              if "error" in v}
    assert not failed, f"measurements failed: {failed}"

    limit = results["limit"]
    _positive(limit["tokenizer"], "tokens_per_s", "tokens", "documents")
    _positive(limit["other_backend"], "tokens_per_s", "encode_batch.tokens_per_s")
    assert limit["other_backend"]["ids_differ_in_documents"] == 0
    _positive(limit["parquet"], "bytes_per_s", "documents_per_s", "arrow.bytes_per_s")
    _positive(limit["produce"], "tokens_per_s", "profile.fractions.tokenize")
    _positive(limit["tokenizer_after_ours"], "tokens_per_s")  # the machine's speed, again
    # --quick makes one workers' run, between the two measures of the limit.
    (run,) = results["worker_runs"]
    assert run["limit_before"] == limit["tokenizer"]["tokens_per_s"]
    assert run["limit_after"] == limit["tokenizer_after_ours"]["tokens_per_s"]

    ours = results["ours"]
    _positive(ours, "tokens_per_s", "tokens_per_s_with_startup", "startup_s", "steps", "tokens",
              "seconds_per_batch", "steady_tokens_per_s", "steady_seconds_per_batch",
              "memory.host.peak_bytes", "memory.total_peak_bytes")
    assert ours["workers"] == results["setting"]["cpus"]
    assert 0 <= ours["stall_fraction"] <= 1
    # The workers alone, from the first row (a quick run may end before they take over from a
    # warm start).
    cold = results["ours_no_warm_start"]
    _positive(cold, "tokens_per_s", "steady_seconds_per_batch", "object_store_bytes_peak",
              "memory.workers.peak_bytes")
    assert not cold.get("warm_start_rows")

    # A smoke test runs each peer once, on the feed's backend (a full run adds tiktoken).
    assert set(results["peers"]) == {"grain", "grain_mp", "ray_data"}
    for name, peer in results["peers"].items():
        _positive(peer, "tokens_per_s", "tokens_per_s_with_startup", "startup_s", "steps",
                  "tokens", "memory.host.peak_bytes", "steady_tokens_per_s")
        assert peer["steps"] == results["setting"]["steps"], name

    _positive(results["host_assembly"], "assembly_us", "np_copy_us", "make_array_us",
              "row_copy_us", "assembly_over_np_copy")
    step = results["training_step"]
    _positive(step, "step_time_s", "pipeline_seconds_per_batch", "steps")
    assert 0 <= step["stall_fraction"] <= 1
    _positive(results["training_step_no_warm_start"], "step_time_s", "steps")
    assert results["ratios"]["rates_from"] == "ours_no_warm_start"
    store = step["memory"]["object_store"]  # Ray's own figure: best effort, else a reason
    assert store["polls_ok"] > 0 or store.get("error")
    _positive(results["ratios"], "ours_over_cpus_x_limit", "ours_over_best_peer_with_startup",
              "steady_ours_over_cpus_x_limit", "limit_drift")
    assert results["ratios"]["limit_drift"] == pytest.approx(
        limit["tokenizer_after_ours"]["tokens_per_s"] / limit["tokenizer"]["tokens_per_s"])
    # The step is set from the steady time per batch (of the one workers' run); --quick judges
    # no target.
    assert step["pipeline_seconds_per_batch"] == pytest.approx(cold["steady_seconds_per_batch"])
    assert results["ratios"]["meets_target"] is None
    assert results["ratios"]["meets_grain_target"] is None
    assert results["ratios"]["steady_ours_over_grain"] > 0
    assert results["ratios"]["meets_target_steady"] is None
    assert set(results["ratios"]["ours_over_each_peer"]) == set(results["peers"])


@pytest.mark.parametrize("name", ["results.json", "results-tiny.json", "results-cl100k.json"])
def test_a_stored_results_file_reads_into_the_model_and_writes_back_the_same(name):
    """The typed model reads every key of a stored full run and writes each back; the ratios
    computed again from it are the stored ones."""
    from benchmarks.ratios import compute_ratios

    raw = json.loads((ROOT / "benchmarks" / name).read_text())
    results = BenchResults.from_json(raw)
    assert json.loads(json.dumps(results.to_json())) == raw
    assert results.ratios is not None and results.ratios.details == {}  # every ratio is typed
    stored, again = raw["ratios"], compute_ratios(results).to_json()
    assert set(again) == set(stored)
    for key, value in stored.items():
        assert again[key] == (pytest.approx(value) if isinstance(value, float) else value), key


def test_a_quick_run_writes_its_verdicts_as_null_beside_the_ratios_they_judge():
    from benchmarks.ratios import compute_ratios

    raw = json.loads((ROOT / "benchmarks" / "results.json").read_text())
    results = BenchResults.from_json({**raw, "mode": "quick"})
    ratios = compute_ratios(results).to_json()
    for verdict in ("meets_target", "meets_target_steady", "meets_grain_target",
                    "meets_grain_target_steady"):
        assert verdict in ratios and ratios[verdict] is None, verdict
    assert ratios["ours_over_cpus_x_limit"] > 0


@pytest.mark.parametrize("name", ["results.json", "results-tiny.json", "results-cl100k.json"])
def test_the_grain_target_is_judged_from_the_first_batch_and_steady(name):
    """On each stored full run: ours over the best grain run by both measures, each judged."""
    from benchmarks.ratios import TARGET_OVER_GRAIN, compute_ratios, workers_rates
    from benchmarks.report import fmt_against, format_table

    results = _load(name)
    cpus = results.setting.cpus
    ours = workers_rates(results)  # the median over the workers' runs
    grains = [p for n, p in results.peers.items() if n in ("grain", "grain_mp")]
    ratios = compute_ratios(results)
    limits = results.limit
    backend = limits.feed_backend if limits.feed_backend.measured else limits.tokenizer
    # Every grain run is between two measures of the limit: the two pipelines' median ratios
    # to it divide.
    assert ratios.grain_ratio_from == "ratios to the limit"
    assert all(len(p.over_limit_by_run) == 3 for p in grains)
    best = max(p.over_limit for p in grains)
    want = cpus * ours.steady_over_cpus_x_limit / max(p.steady_over_limit for p in grains)
    assert ratios.ours_over_grain == pytest.approx(cpus * ours.over_cpus_x_limit / best)
    # The ceiling: every CPU running the grain runs' tokenizer backend alone, over grain.
    ceiling = cpus * backend.tokens_per_s / limits.tokenizer.tokens_per_s / best
    assert ratios.steady_ours_over_grain == pytest.approx(want)
    assert ratios.meets_grain_target_steady == (want >= TARGET_OVER_GRAIN)
    assert ratios.grain_ceiling == pytest.approx(ceiling)
    results.ratios = ratios
    (line,) = [x for x in format_table(results).splitlines() if "best grain" in x]
    verdict = "met" if ratios.meets_grain_target_steady else "missed"
    assert f"; steady {fmt_against(want, TARGET_OVER_GRAIN)} " in line
    assert f", steady {verdict})" in line
    assert f"at most {ceiling:.2f} here" in line


LIMITS = [7.0e6, 6.0e6, 8.0e6, 7.0e6]  # the tokenizer's limit around three workers' runs
RATES = [10.0e6, 13.0e6, 11.0e6]


def _worker_runs(steady: float) -> list[WorkerRun]:
    """Three workers' runs of ``RATES`` between the measures ``LIMITS``, each steady rate
    ``steady`` times its rate."""
    return [WorkerRun(limit_before=LIMITS[i], limit_after=LIMITS[i + 1], tokens_per_s=RATES[i],
                      steady_tokens_per_s=RATES[i] * steady) for i in range(3)]


def _load(name: str = "results.json") -> BenchResults:
    """A stored results file, read through the typed model."""
    return BenchResults.from_json(json.loads((ROOT / "benchmarks" / name).read_text()))


def test_the_ratio_to_the_limit_is_the_median_over_runs_each_between_two_limits():
    """Each workers' run is divided by the mean of the limit measured before and after it;
    the ratio judged is the median of those, and the table names each run's."""
    from benchmarks.ratios import compute_ratios
    from benchmarks.report import format_table

    results = _load()
    cpus = results.setting.cpus
    limits, rates = LIMITS, RATES
    results.worker_runs = _worker_runs(1.01)
    results.worker_runs.append(WorkerRun(limit_before=7.0e6, limit_after=None,
                                         error="ingest run failed"))  # no rate: left out
    ratios = compute_ratios(results)
    by_run = [rates[i] / (cpus * (limits[i] + limits[i + 1]) / 2) for i in range(3)]
    assert ratios.ours_over_cpus_x_limit_by_run == pytest.approx(by_run)
    assert ratios.ours_over_cpus_x_limit == pytest.approx(sorted(by_run)[1])
    assert ratios.steady_ours_over_cpus_x_limit == pytest.approx(sorted(by_run)[1] * 1.01)
    assert ratios.meets_target == (sorted(by_run)[1] >= ratios.target_of_limit)
    assert ratios.worker_runs == 3
    # The other ratios take the median rate.
    produce = results.limit.produce.tokens_per_s
    assert ratios.ours_over_cpus_x_produce == pytest.approx(11.0e6 / (cpus * produce))
    results.ratios = ratios
    table = format_table(results)
    (line,) = [x for x in table.splitlines() if x.startswith("ours / (")]
    assert "(median of " + ", ".join(f"{x:.2f}" for x in by_run) + ")" in line
    assert "3 runs of it, each between two measures of the limit" in table


def test_a_grain_pipeline_counts_its_median_run_and_the_table_lists_every_run():
    """Grain runs three times; the grain ratio divides by its median run, never its best or
    worst, and a failed run is listed but not counted."""
    from benchmarks.ratios import compute_ratios, median_run
    from benchmarks.report import format_table

    runs = [Section(tokens_per_s=8.0e6, steady_tokens_per_s=8.1e6,
                    tokens_per_s_with_startup=6.0e6, startup_s=1.4),
            Section(error="grain failed"),
            Section(tokens_per_s=5.0e6, steady_tokens_per_s=5.2e6,
                    tokens_per_s_with_startup=4.0e6, startup_s=1.5),
            Section(tokens_per_s=9.0e6, steady_tokens_per_s=9.3e6,
                    tokens_per_s_with_startup=7.0e6, startup_s=1.3)]
    got = median_run(runs)
    assert got.tokens_per_s == 8.0e6 and got.steady_tokens_per_s == 8.1e6
    assert got.runs_tokens_per_s == [8.0e6, None, 5.0e6, 9.0e6]
    assert median_run(runs[:1]) == runs[0]  # one run: as it is
    assert median_run([Section(error="a"), Section(error="b")]) == Section(error="b")
    results = _load()
    results.peers = {"grain": dataclasses.replace(got, tokens_per_s=4.0e6,
                                                  steady_tokens_per_s=4.0e6)}
    half = compute_ratios(results).ours_over_grain
    results.peers = {"grain": got}
    results.ratios = compute_ratios(results)
    assert results.ratios.ours_over_grain == pytest.approx(half / 2)
    (line,) = [x for x in format_table(results).splitlines() if x.startswith("grain, 1 process")]
    assert "the median of 4 runs: 8.00 M, failed, 5.00 M, 9.00 M" in line


def test_grain_runs_between_measures_of_the_limit_are_compared_by_their_ratios_to_it():
    """Where every grain run has the limit measured on either side, ours / grain divides the
    two pipelines' median ratios to the limit, not rates taken minutes apart: a machine that
    ran twice as fast during grain's runs leaves the ratio as it is."""
    from benchmarks.ratios import compute_ratios, median_run
    from benchmarks.report import format_table

    results = _load()
    cpus = results.setting.cpus
    limits, rates = LIMITS, RATES
    results.worker_runs = _worker_runs(1.0)
    ours_by_run = sorted(rates[i] / ((limits[i] + limits[i + 1]) / 2) for i in range(3))

    def grain(speed: float) -> Section:
        # Three runs at 0.30, 0.25 and 0.35 of the limit, on a machine `speed` times as fast.
        glimits = [speed * x for x in (6.0e6, 6.0e6, 8.0e6, 6.0e6)]
        runs = [Section(tokens_per_s=f * (glimits[i] + glimits[i + 1]) / 2,
                        steady_tokens_per_s=f * (glimits[i] + glimits[i + 1]) / 2,
                        tokens_per_s_with_startup=1.0e6, startup_s=1.0,
                        limit_before=glimits[i], limit_after=glimits[i + 1])
                for i, f in enumerate((0.30, 0.25, 0.35))]
        return median_run(runs)

    got = grain(1.0)
    assert got.over_limit_by_run == pytest.approx([0.30, 0.25, 0.35])  # in run order
    assert got.over_limit == pytest.approx(0.30)
    want = ours_by_run[1] / 0.30
    for speed in (1.0, 2.0):
        results.peers = {"grain": grain(speed)}
        ratios = compute_ratios(results)
        assert ratios.grain_ratio_from == "ratios to the limit"
        assert ratios.ours_over_grain == pytest.approx(want)
        assert ratios.steady_ours_over_grain == pytest.approx(want)
    # The ceiling: the backend alone over the limit, on every CPU, over grain's ratio.
    limit = results.limit
    backend = limit.feed_backend.tokens_per_s / limit.tokenizer.tokens_per_s
    assert ratios.grain_ceiling == pytest.approx(cpus * backend / 0.30)
    results.ratios = ratios
    table = format_table(results).splitlines()
    (line,) = [x for x in table if x.startswith("grain, 1 process")]
    assert "over the limit on either side: 0.30, 0.25, 0.35" in line
    (line,) = [x for x in table if x.startswith("ours / best grain")]
    assert "median ratio to the limit measured on either side" in line
    # A grain run with no measure of the limit beside it (both failed): rates, as before.
    runs = [dataclasses.replace(results.peers["grain"], limit_before=None, limit_after=None,
                                over_limit=None, steady_over_limit=None, over_limit_by_run=None,
                                steady_over_limit_by_run=None),
            Section(tokens_per_s=3.0e6, tokens_per_s_with_startup=2.0e6,
                    limit_before=6.0e6, limit_after=6.2e6)]
    results.peers["grain"] = median_run(runs)
    assert results.peers["grain"].over_limit is None
    assert "over_limit" not in results.peers["grain"].to_json()
    assert compute_ratios(results).grain_ratio_from == "rates"


def test_a_peer_whose_first_batch_came_late_is_no_best_peer():
    """A peer that spent most of its run before its first batch delivered batches already
    made: its rate from the first batch is left out of the best peer, and the table says why."""
    from benchmarks.ratios import compute_ratios
    from benchmarks.report import format_table

    results = _load("results-cl100k.json")
    ray_data = results.peers["ray_data"]  # whole files as blocks: a late first batch
    assert ray_data.startup_s > ray_data.wall_s / 2
    ratios = compute_ratios(results)
    assert "ray_data" in ratios.peers_left_out and ratios.best_peer != "ray_data"
    results.ratios = ratios
    (line,) = [x for x in format_table(results).splitlines() if x.startswith("Ray Data")]
    assert f"first batch after {ray_data.startup_s:.0f} of its" in line
    # The same peer with its first batch before half its run is a production rate again.
    ray_data.startup_s = 0.4 * ray_data.wall_s
    ray_data.tokens_per_s = 1.0  # and slower than the others: no best peer either way
    assert "ray_data" not in compute_ratios(results).peers_left_out


def test_the_run_is_provisional_when_other_programs_keep_cpus_busy_at_its_start():
    """The warning counts the CPUs busy just before the start, not the load average, which a
    benchmark that ended a minute before still raises; older files keep the load average."""
    from benchmarks.machine import busy_cpus
    from benchmarks.report import format_table

    results = json.loads((ROOT / "benchmarks" / "results.json").read_text())

    def warned(**machine) -> bool:
        r = {**results, "machine": {k: v for k, v in results["machine"].items()
                                    if k not in ("busy_cpus_start", "load_average_start")}}
        r["machine"].update(machine)
        return "WARNING" in format_table(BenchResults.from_json(r)).splitlines()[1]

    assert not warned(busy_cpus_start=0.1, load_average_start=[2.8, 2.0, 1.5])
    assert warned(busy_cpus_start=1.2, load_average_start=[0.1, 0.1, 0.1])
    assert warned(load_average_start=[2.8, 2.0, 1.5])
    assert not warned(load_average_start=[0.2, 0.2, 0.2])
    # A real probe: one busy thread beside it counts about one CPU (two: no more than both).
    stop = time.monotonic() + 1.5

    def spin() -> None:
        while time.monotonic() < stop:
            pass

    t = threading.Thread(target=spin)
    t.start()
    try:
        busy = busy_cpus(1.0)
    finally:
        t.join()
    assert 0.6 < busy <= (os.cpu_count() or 1) + 0.1, busy


def test_a_ratio_just_under_its_target_is_not_printed_as_reaching_it():
    from benchmarks.report import fmt_against

    assert fmt_against(0.8451, 0.85) == "0.845"
    assert fmt_against(0.8449, 0.85) == "0.84"
    assert fmt_against(0.8501, 0.85) == "0.85"
    assert fmt_against(0.8149, 0.85) == "0.81"
    assert fmt_against(2.996, 3.0) == "2.996"


def test_every_pipeline_reads_the_corpus_epochs_times(tmp_path):
    """``--epochs``: our config's num_epochs, and grain reads every document that many times."""
    from benchmarks.corpus import EPOCHS, make_spec
    from ingest.cli import parse_args

    config = _small_config(tmp_path, 5)
    assert make_spec(str(config), quick=False, steps=None).config["num_epochs"] == EPOCHS
    assert make_spec(str(config), quick=True, steps=None).config["num_epochs"] == 1
    tokens = {}
    for epochs in (1, 2):
        spec = make_spec(str(config), quick=False, steps=None, epochs=epochs)
        assert spec.config["num_epochs"] == epochs
        path = tmp_path / f"spec{epochs}.json"
        spec.save(str(path))
        proc = _run_program([sys.executable, "-m", "benchmarks.peers", "grain", "--spec",
                             str(path)])
        tokens[epochs] = json.loads(proc.stdout.strip().splitlines()[-1])["tokens"]
    assert tokens[1] > 0 and tokens[2] == 2 * tokens[1]
    with pytest.raises(SystemExit):
        parse_args(["bench", "--epochs", "0"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ray_data_peer_packs_the_rows_our_stream_packs(seed):
    """The Ray Data peer's UDF does our work (concat, left shift, masks), not less."""
    rng = np.random.default_rng(seed)
    seq_len, eos = 16, 99
    docs = [rng.integers(0, 90, size=int(n), dtype=np.int32) for n in rng.integers(1, 40, 12)]
    theirs = pack_rows(docs, eos, seq_len)
    flat = np.concatenate([np.append(d, eos) for d in docs]).astype(np.int32)
    starts = np.concatenate([np.eye(1, len(d) + 1, dtype=bool)[0] for d in docs])
    n = len(theirs["inputs"])
    assert n == (len(flat) - 1) // seq_len
    ours = fields_of(*shift_rows(*concat_rows(flat, starts, n, seq_len, seq_len + 1),
                                 shift="left", predict_across_documents=False, eos_id=eos))
    for i, field in enumerate(FIELDS):
        np.testing.assert_array_equal(theirs[field], ours[i], err_msg=field)


def _small_config(tmp_path: Path, seed: int, **fields) -> Path:
    """A config of a small Parquet corpus written under ``tmp_path``."""
    from tests.helpers import write_parquet_corpus

    write_parquet_corpus(tmp_path / "corpus", n_files=2, docs_per_file=120, row_group_size=40,
                         seed=seed)
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({
        "sources": [{"paths": [str(tmp_path / "corpus")]}], "seq_len": 64,
        "global_batch_size": 8, "num_streams": 4, "unit_rows": 20, **fields}))
    return config


def _run_program(cmd: list[str]) -> subprocess.CompletedProcess:
    """Runs a benchmark program to its end, failing the test on a deadline or an error."""
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} ran past {TIMEOUT_S} s; stderr so far:\n{e.stderr}")
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}"
    return proc


@pytest.mark.slow
def test_chunk_sweep_reports_each_size_with_its_object_store_bound(tmp_path):
    config = _small_config(tmp_path, 3, prefetch=2)
    proc = _run_program([sys.executable, "-m", "benchmarks.chunk_sweep", "--config",
                         str(config), "--epochs", "2", "--rows", "4", "8", "--rounds", "1"])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["epochs"] == 2 and set(out["runs"]) == {"4", "8"}
    for r in ("4", "8"):
        _positive(out["runs"][r], "object_store_bytes_bound")
        assert len(out["runs"][r]["tokens_per_s"]) == 1 and out["runs"][r]["tokens_per_s"][0] > 0
        # The steady rate of each run, or None where it had too few steps for a steady part.
        steady = out["runs"][r]["steady_tokens_per_s"]
        assert len(steady) == 1 and (steady[0] is None or steady[0] > 0)
    # The bound is per chunk: twice the rows, twice the bytes (prefetch 2 fits either way).
    assert out["runs"]["8"]["object_store_bytes_bound"] == \
        2 * out["runs"]["4"]["object_store_bytes_bound"]


def test_machine_profile_puts_each_perf_sample_in_its_part():
    from benchmarks.machine_profile import split_samples, top_symbols

    lines = [  # `perf script -F pid,ip,sym,dso`, as perf 6.1 prints it
        " 101  7f01 fancy_regex::vm::run_with (/venv/tiktoken/_tiktoken.cpython-311-x86_64-linux-gnu.so)",
        " 101  7f02 __memcmp_evex_movbe (/usr/lib/x86_64-linux-gnu/libc.so.6)",
        " 101  7f0c [unknown] (/venv/riptoken/_riptoken.cpython-311-x86_64-linux-gnu.so)",
        " 101  7f0d [unknown] (/venv/rs_bpe/bpe.cpython-311-x86_64-linux-gnu.so)",
        " 101  7f0e [unknown] (/venv/bpe_openai/_bindings.abi3.so)",
        " 102  7f0f [unknown] (/venv/other_package/bpe.cpython-311-x86_64-linux-gnu.so)",
        " 101  7f03 __memmove_avx512_unaligned_erms (/usr/lib/x86_64-linux-gnu/libc.so.6)",
        " 102  7f04 _PyEval_EvalFrameDefault (/usr/lib/libpython3.11.so.1.0)",
        " 102  ffff exc_page_fault ([kernel.kallsyms])",
        " 102  7f05 INT_add_X86_V3 (/venv/numpy/_core/_multiarray_umath.cpython-311-x86_64-linux-gnu.so)",
        " 102  7f06 [unknown] (/venv/ray/_raylet.so)",
        " 102  7f07 [unknown] (/venv/pyarrow/libarrow.so.2600)",
        " 102  7f08 [unknown] ([unknown])",
        " 200  7f09 memcpy (/usr/lib/x86_64-linux-gnu/libc.so.6)",
        " 300  7f0a [unknown] (/venv/ray/core/src/ray/raylet/raylet)",
        " 400  7f0b __memcmp_evex_movbe (/usr/lib/x86_64-linux-gnu/libc.so.6)",
        "   0  ffff pv_native_safe_halt ([kernel.kallsyms])",
        "   0  ffff pv_native_safe_halt ([kernel.kallsyms])",
        "not a sample line",
    ]
    roles = {101: "worker", 102: "worker", 200: "host", 300: "ray_system"}
    assert split_samples(lines, roles) == {
        "tokenizer": 5, "worker_libc": 1, "worker_python": 1, "worker_kernel": 1,
        "worker_numpy": 1, "worker_ray": 1, "worker_arrow": 1, "worker_other": 2, "host": 1,
        "ray_system": 1, "other_programs": 1, "idle": 2}
    top = top_symbols(lines + lines[:1], roles, 1)
    assert top["tokenizer"] == [("_tiktoken.cpython-311-x86_64-linux-gnu.so:fancy_regex::vm::"
                                 "run_with", 2)]
    assert top["idle"] == [("[kernel.kallsyms]:pv_native_safe_halt", 2)]
    assert sum(len(v) for v in top_symbols(lines, roles, 5).values()) == 17  # idle twice


def test_scaling_sweeps_powers_of_two_up_to_the_cpus():
    from benchmarks.scaling import sweep_points

    assert sweep_points(1) == [1]
    assert sweep_points(2) == [1, 2]
    assert sweep_points(6) == [1, 2, 4, 6]
    assert sweep_points(16) == [1, 2, 4, 8, 16]


def test_scaling_plot_is_a_png_and_says_why_when_nothing_ran(tmp_path):
    from benchmarks.scaling import plot

    pytest.importorskip("matplotlib")  # the `bench` extra; `make test` installs only `test`
    runs = [{"workers": 1, "tokens_per_s": 7e6, "steady_tokens_per_s": 6.5e6},
            {"workers": 2, "error": "timed out"}]
    path = tmp_path / "w.png"
    assert plot({"cpus": 2, "runs": runs, "single_core_limit_tokens_per_s": 1e7},
                str(path)) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot({"cpus": 2, "runs": runs[1:]}, str(tmp_path / "x.png")) == \
        "no run of the sweep succeeded"


def test_busy_between_takes_the_cpu_of_the_samples_inside_the_window():
    from benchmarks.measure import busy_between

    series = [[0.0, {"1": ["host", 0.0], "2": ["workers", 0.0]}],
              [1.0, {"1": ["host", 0.5], "2": ["workers", 1.0]}],
              [3.0, {"1": ["host", 1.0], "2": ["workers", 2.5], "3": ["workers", 0.4]}],
              [5.0, {"1": ["host", 1.2], "2": ["workers", 4.5], "3": ["workers", 2.4]}]]
    b = busy_between(series, 0.5, 5.0)  # the samples at 1 s and 5 s
    assert (b["from_s"], b["to_s"]) == (1.0, 5.0)
    assert b["cores"] == {"host": 0.175, "workers": 0.875}  # process 3 began inside: left out
    assert b["workers"] == [0.875]
    assert busy_between(series, 2.0, 4.0) is None  # one sample inside
    assert busy_between(series, 0.5, 3.0, min_s=2.5) is None  # samples 2 s apart


def test_worker_profile_counts_a_fast_backends_tokenizer_once():
    from benchmarks.worker_profile import split_worker_trace

    def frames(tid, spans):  # (name, begin s, end s), nested by time
        ev = [(b, "B", n) for n, b, _ in spans] + [(e, "E", n) for n, _, e in spans]
        ev.sort(key=lambda x: (x[0], x[1] == "B"))  # an end before a begin at the same time
        return [{"tid": tid, "ph": ph, "name": n, "ts": t * 1e6} for t, ph, n in ev]

    events = frames(1, [
        ("StreamWorker.produce", 0.0, 1.0),
        ("read_texts", 0.0, 0.1),
        ("FastBPETokenizer.encode_docs", 0.1, 0.7),
        ("GuardedTuetoken.encode_docs", 0.1, 0.6),
        ("TiktokenTokenizer.encode_docs", 0.6, 0.7),  # a fallback inside the fast backend
        ("concat_fields", 0.7, 0.8),
        ("StreamWorker.produce", 1.5, 2.0),
        ("TiktokenTokenizer.encode_docs", 1.5, 1.9),
    ]) + frames(2, [("TiktokenTokenizer.encode_docs", 0.0, 5.0)])  # another thread: ignored
    r = split_worker_trace(events)
    assert r["window_s"] == pytest.approx(2.0)
    sec = r["seconds"]
    assert sec["tokenize"] == pytest.approx(0.6 + 0.4)
    assert sec["parquet_read"] == pytest.approx(0.1)
    assert sec["pack_shift"] == pytest.approx(0.1)
    assert sec["produce"] == pytest.approx(1.5)
    f = r["fractions_of_window"]
    assert f["outside_produce"] == pytest.approx(0.25)
    assert f["produce_other"] == pytest.approx((1.5 - 1.2) / 2.0)


def test_worker_sweep_leaves_one_cpu_to_the_host():
    from benchmarks.worker_sweep import default_points

    assert default_points(1) == [1]
    assert default_points(2) == [1]
    assert default_points(4) == [1, 2, 3]
    assert default_points(16) == [1, 2, 4, 8, 15]


def test_worker_sweep_sizes_a_point_by_the_batches_its_overrides_give():
    from benchmarks.worker_sweep import point_plan

    config = {"seq_len": 1024, "global_batch_size": 32}
    steps, epochs = point_plan(16, 5.0, 6.5e6, config, 5_000_000)
    assert steps == -(-5 * 16 * 6_500_000 // (32 * 1024))
    # 1.2 x the tokens the steps take, plus an epoch
    assert epochs == -(-12 * steps * 32 * 1024 // 50_000_000) + 1
    # four times the rows a step: a quarter of the steps, as many epochs
    steps4, epochs4 = point_plan(16, 5.0, 6.5e6, dict(config, global_batch_size=128),
                                 5_000_000)
    assert steps4 == -(-steps // 4)
    assert abs(epochs4 - epochs) <= 1
    assert point_plan(1, 0.01, 1e3, config, 5_000_000) == (50, 2)  # at least 50 steps
    assert point_plan(2, 5.0, 6.5e6, config, None)[1] == 1  # corpus size not known


@pytest.mark.slow
def test_worker_sweep_sizes_each_point_by_its_workers_and_records_each_worker(tmp_path):
    config = _small_config(tmp_path, 5)
    out = tmp_path / "sweep.json"
    limit = 20_000  # tokens/s: small, so that each point is a few hundred steps
    proc = _run_program([sys.executable, "-m", "benchmarks.worker_sweep", str(config),
                         "--workers", "1", "2", "--seconds", "1", "--limit", str(limit),
                         "--corpus-tokens", "5000", "--cores-limits", "produce",
                         "--set", "prefetch=3", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["setting"]["overrides"] == {"prefetch": 3}
    one, two = r["runs"]
    # W cores of the limit for the given seconds, in steps of 8 x 64 tokens (at least 50).
    assert one["steps"] == max(50, -(-1 * 1 * limit // (8 * 64)))
    assert two["steps"] == max(50, -(-1 * 2 * limit // (8 * 64)))
    for run, w in ((one, 1), (two, 2)):
        assert run["tokens"] == run["steps"] * 8 * 64
        _positive(run, "tokens_per_s", "produce_on_w_cores_tokens_per_s", "of_w_x_limit")
        assert len(run["workers_detail"]) == w
        # produce alone ran on W cores for as long as the run's work, pass after pass
        assert len(run["produce_on_w_cores_passes"]) == w
        assert all(p and min(p) > 0 for p in run["produce_on_w_cores_passes"])
        assert run["cores_limits_seconds"] >= 3.0
        for d in run["workers_detail"]:
            assert d["user_s"] > 0 and d["minor_faults"] > 0
            assert 0 < d["main_thread_s"] <= d["user_s"] + d["system_s"] + 0.02
        # pin_workers (the default): no two workers on one CPU (a worker that found every CPU
        # claimed, by another feed's workers, floats)
        bound = [d["bound_to_cpu"] for d in run["workers_detail"] if d["bound_to_cpu"] is not None]
        assert len(set(bound)) == len(bound)
    assert "produce on W cores" in proc.stderr


def test_the_produce_split_counts_a_tokenizer_call_inside_another_once(tmp_path):
    """``ingest bench``'s split of ``produce``'s time on cl100k, whose backend's
    ``encode_docs`` runs inside ``FastBPETokenizer.encode_docs``: the tokenizer's share is
    within ``produce``'s time and the parts add up to it."""
    import cProfile
    import pstats

    import pyarrow as pa
    import pyarrow.parquet as pq
    from helpers import make_texts

    from ingest import Config, SourceConfig
    from ingest.plan.build import build_plan
    from ingest.stream.kinds import Stream
    from ingest.tokenize.tokenizer import load_tokenizer

    texts = [t + ("\ncafé\n" if i % 3 == 0 else "") + t for i, t in
             enumerate(make_texts(400, seed=9, max_words=200))]
    pq.write_table(pa.table({"text": texts}), str(tmp_path / "a.parquet"), row_group_size=50)
    cfg = Config(sources=(SourceConfig(paths=(str(tmp_path / "a.parquet"),)),),
                 tokenizer="cl100k", seq_len=128, global_batch_size=8, num_streams=2)
    assert load_tokenizer("cl100k", cfg.runtime.tokenizer_backend).backend == "toktok"
    stream = Stream(cfg, build_plan(cfg), 0)
    prof = cProfile.Profile()
    prof.enable()
    while not stream.produce(64).exhausted:
        pass
    prof.disable()
    total, parts = produce_split(pstats.Stats(prof).stats)
    assert total > 0 and 0 < parts["tokenize"] < total, (total, parts)
    assert sum(parts.values()) == pytest.approx(total), parts

