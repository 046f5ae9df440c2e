"""The bench's results as the plain-text table it prints (the one RESULTS.md shows).

    python -m benchmarks.report benchmarks/results.json    # the table of a results file
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from benchmarks.machine import BUSY_PROBE_S, ROOT
from benchmarks.ratios import is_late
from benchmarks.results_model import BenchResults, Ratios, Section

__all__ = ["format_table", "fmt_against"]

# Other programs keeping this many CPUs busy at the start make the run provisional.
BUSY_WARNING = 0.5
DRIFT_WARNING = 0.05  # the tokenizer's limit moving more than this between its two measures
PEER_TITLES = {"grain": "grain, 1 process", "grain_mp": "grain mp_prefetch({cpus})",
               "ray_data": "Ray Data ({cpus} CPUs)",
               "grain_tiktoken": "grain, 1 process, tiktoken",
               "grain_mp_tiktoken": "grain mp_prefetch({cpus}), tiktoken"}
_WIDTHS = (34, 14, 12, 16, 10, 22)


def _tok(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 1e6:.2f} M" if x >= 1e5 else f"{x:,.0f}"


def _mib(x: float | None) -> str:
    return "-" if not x else f"{x / 2**20:,.0f}"


def _mem(section: Section) -> str:
    m = section.memory
    if not m:
        return "-"
    return (f"{_mib(m['host']['peak_bytes'])} / {_mib(m['workers']['peak_bytes'])} / "
            f"{_mib(m['total_peak_bytes'])}")


def fmt_against(x: float, target: float) -> str:
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


def _met(verdict: bool | None) -> str:
    return "met" if verdict else "missed"


def _row(name: str, sec: Section, note: str = "") -> str:
    w = _WIDTHS
    if sec.error is not None:
        return f"{name.ljust(w[0])}  error: {sec.error[:160]}"
    cells = (name, _tok(sec.tokens_per_s), _tok(sec.steady_tokens_per_s),
             _tok(sec.tokens_per_s_with_startup),
             f"{sec.startup_s:.2f}" if sec.startup_s is not None else "-", _mem(sec))
    return ("  ".join(c.ljust(n) for c, n in zip(cells, w, strict=True))
            + (f"  {note}" if note else ""))


def _header(r: BenchResults) -> list[str]:
    s, cpus = r.setting, r.setting.cpus
    lines = [f"ingest bench ({r.mode}): {len(s.files)} file(s), tokenizer {s.tokenizer}, "
             f"seq_len {s.seq_len}, batch {s.global_batch_size}, {cpus} CPUs, "
             f"epochs {s.epochs}, steps {s.steps}"]
    busy = r.machine.busy_cpus_start
    load = (r.machine.load_average_start or (0,))[0]
    if busy is not None and busy > BUSY_WARNING:
        lines.append(f"WARNING: {busy:.1f} CPUs busy in the {BUSY_PROBE_S:.0f} s before the "
                     f"start: another program was running, so these figures are noisy "
                     f"(provisional)")
    elif busy is None and load > BUSY_WARNING:
        lines.append(f"WARNING: load average {load:.1f} at start: another program was busy, so "
                     f"these figures are noisy (provisional)")
    head = ("pipeline", "tokens/s", "steady", "tok/s w/ startup", "startup s",
            "peak RSS MiB h/w/total")
    return lines + ["", "  ".join(h.ljust(n) for h, n in zip(head, _WIDTHS, strict=True)),
                    "  ".join("-" * n for n in _WIDTHS)]


def _limit_lines(r: BenchResults) -> list[str]:
    w, cpus, lim = _WIDTHS, r.setting.cpus, r.limit
    tok = lim.tokenizer
    lines = [_row(f"tokenizer limit, 1 core ({tok.details.get('backend', '?')})", tok)]
    if tok.measured:
        lines.append(f"{'  x ' + str(cpus) + ' CPUs':<{w[0]}}  {_tok(cpus * tok.tokens_per_s)}")
    again = lim.tokenizer_after_ours
    if again is not None and again.measured and tok.measured:
        drift = again.tokens_per_s / tok.tokens_per_s - 1
        lines.append(f"{'  again, right after ours':<{w[0]}}  {_tok(again.tokens_per_s):<{w[1]}}"
                     f"  the machine's speed moved {drift:+.0%} in between"
                     + (": compare ratios with care" if abs(drift) > DRIFT_WARNING else ""))
    fb = lim.feed_backend
    if fb.measured or fb.error is not None:
        lines.append(_row(f"feed's backend, 1 core ({fb.details.get('backend', '?')})", fb,
                          f"{fb.tokens_per_s / tok.tokens_per_s:.2f} x tiktoken"
                          if fb.measured and tok.measured else ""))
    other = lim.other_backend
    if "skipped" in other.details:
        lines.append(f"{'other tokenizer backend':<{w[0]}}  skipped: {other.details['skipped']}")
    else:
        fast = other.details.get("encode_batch_fast", {})
        batch = other.details.get("encode_batch")
        note = f"encode_batch (with offsets): {_tok(batch['tokens_per_s'])}" if batch else ""
        shown = Section.from_json({**other.to_json(), **(
            {"tokens_per_s": fast["tokens_per_s"]} if fast else {})})
        lines.append(_row("HF tokenizers, 1 core", shown, note))
    prod = lim.produce
    frac = (prod.details.get("profile") or {}).get("fractions") or {}
    lines.append(_row("our Stream.produce, 1 core", prod,
                      "time: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in
                                           sorted(frac.items(), key=lambda kv: -kv[1]))
                      if frac else ""))
    pq_ = lim.parquet
    if pq_.error is not None:
        lines.append(_row("Parquet read, 1 core", pq_))
    else:
        d = pq_.details
        lines.append(f"{'Parquet read, 1 core':<{w[0]}}  {d['bytes_per_s'] / 1e6:,.0f} MB/s of "
                     f"text, {d['documents_per_s']:,.0f} docs/s (into Python str; Arrow only: "
                     f"{d['arrow']['bytes_per_s'] / 1e6:,.0f} MB/s)")
    return lines


def _ours_lines(r: BenchResults) -> list[str]:
    w, cpus, ours = _WIDTHS, r.setting.cpus, r.ours
    d = ours.details
    step_memory = r.training_step.memory if r.training_step is not None else {}
    store = step_memory.get("object_store") or {}
    note = ""
    if ours.stall_fraction is not None:
        note = (f"stall {100 * ours.stall_fraction:.0f}% (no step); object store: feed's "
                f"peak {_mib(d.get('object_store_bytes_peak'))} MiB (bound "
                f"{_mib(d.get('object_store_bytes_bound'))}), Ray's used peak "
                f"{_mib(store.get('used_peak_bytes'))} MiB (step run)")
    lines = [_row(f"ours: ray, {cpus} workers", ours, note + (
        f"; warm start: {d['warm_start_rows']:,} rows made by the host"
        if d.get("warm_start_rows") else ""))]
    if r.ours_no_warm_start is not None:
        lines.append(_row("  the same, --no-warm-start", r.ours_no_warm_start))
    runs = [x for x in r.worker_runs if x.tokens_per_s]
    if len(runs) > 1:
        lines.append(f"{'':<{w[0]}}  {len(runs)} runs of it, each between two measures of the "
                     f"limit: " + ", ".join(_tok(x.tokens_per_s) for x in runs)
                     + " tokens/s; the ratios below take the median")
    mem = ours.memory
    if (mem.get("workers") or {}).get("max_process_bytes"):
        wk, host = mem["workers"], mem.get("host") or {}
        lines.append(f"{'':<{w[0]}}  one worker's peak RSS {_mib(wk['max_process_bytes'])} MiB, "
                     f"{_mib(wk.get('max_process_own_bytes'))} MiB without shared-memory pages "
                     f"(Ray's object store, mapped in; the host: "
                     f"{_mib(host.get('max_process_own_bytes'))} of "
                     f"{_mib(host.get('max_process_bytes'))} MiB)")
    return lines


def _peer_lines(r: BenchResults, ra: Ratios) -> list[str]:
    cpus, lines = r.setting.cpus, []
    for name, sec in r.peers.items():
        note = ""
        if name in (ra.peers_left_out or ()):
            d = sec.details
            why = (f"batches came in bursts (median gap {d['median_gap_s'] * 1e3:.1f} ms, "
                   f"mean {d['mean_gap_s'] * 1e3:.1f} ms)" if sec.bursty else
                   f"first batch after {sec.startup_s:.0f} of its {sec.wall_s:.0f} s"
                   if is_late(sec) else f"faster than {cpus} CPUs can tokenize")
            note = f"{why}: its tokens/s from the first batch counts batches made before it"
        elif sec.runs_tokens_per_s:
            rates = sec.runs_tokens_per_s
            note = (f"the median of {len(rates)} runs: "
                    + ", ".join(_tok(x) if x else "failed" for x in rates)
                    + ("; over the limit on either side: "
                       + ", ".join(f"{x:.2f}" for x in sec.over_limit_by_run)
                       if sec.over_limit_by_run else ""))
        lines.append(_row(PEER_TITLES[name].format(cpus=cpus), sec, note))
    return lines


def _cpu_table(r: BenchResults) -> list[str]:
    """Where the CPU went during each run, and what other programs took meanwhile."""
    w = (34, 8, 8, 9, 11, 15)
    head = ("CPU seconds", "wall", "host", "workers", "Ray system", "other programs")
    lines = ["  ".join(h.ljust(n) for h, n in zip(head, w, strict=True))]
    runs = [("ours", r.ours), ("ours, --no-warm-start", r.ours_no_warm_start),
            ("training step run", r.training_step), *r.peers.items()]
    for name, sec in runs:
        m = sec.memory if sec is not None else {}
        if "cpu_s" not in m:
            continue
        c = m["cpu_s"]
        cells = (name, f"{m['wall_s']:.1f}", f"{c['host']:.1f}", f"{c['workers']:.1f}",
                 f"{c['ray_system'] + c['ray_idle_workers']:.1f}",
                 f"{m['other_programs_cpu_s']:.1f}")
        lines.append("  ".join(x.ljust(n) for x, n in zip(cells, w, strict=True)))
    return lines


def _assembly_lines(a: Section | None) -> list[str]:
    if a is None:
        return []
    if a.error is not None:
        return [f"host assembly: error: {a.error[:160]}"]
    d = a.details
    frac_batch = d.get("fraction_of_our_batch_time")
    lines = [f"host assembly of one batch ({d['batch_bytes'] / 2**20:.2f} MiB, {d['devices']} "
             f"device(s)): {d['assembly_us'] / 1e3:.3f} ms = {d['assembly_over_np_copy']:.0f} x "
             f"np.copy ({d['np_copy_us'] / 1e3:.3f} ms); row copies {d['row_copy_us'] / 1e3:.3f} "
             f"ms, 6 device arrays {d['make_array_us'] / 1e3:.3f} ms"
             + (f"; {100 * frac_batch:.1f}% of our time per batch" if frac_batch else "")]
    if d.get("sweep"):
        lines.append("  larger batches (synthetic chunks): " + ", ".join(
            f"{x['global_batch_size']}x{x['seq_len']} {x['assembly_over_np_copy']:.1f} x"
            for x in d["sweep"]) + " np.copy")
    return lines


def _step_lines(r: BenchResults) -> list[str]:
    lines = []
    for st, how in ((r.training_step, ""), (r.training_step_no_warm_start, ", --no-warm-start")):
        if st is None:
            continue
        if st.error is not None:
            lines.append(f"training step{how}: error: {st.error[:160]}")
            continue
        d: dict[str, Any] = st.details
        lines.append(f"training step of {d['step_time_s'] * 1e3:.2f} ms ({d['step_time_factor']}"
                     f" x our steady {d['pipeline_seconds_per_batch'] * 1e3:.2f} ms per batch"
                     f"{how}): stall {100 * st.stall_fraction:.1f}%"
                     + (f" (from step {d['steady_from_step']}: "
                        f"{100 * d['steady_stall_fraction']:.2f}%)"
                        if d.get("steady_from_step") else "")
                     + (f"; {d['warm_start_rows']:,} rows from the host while Ray started"
                        if d.get("warm_start_rows") else ""))
    sc = r.scaling
    if sc is not None and sc.runs is not None:
        lines.append("tokens/s by workers: " + ", ".join(
            f"{x['workers']}: error" if "error" in x else
            f"{x['workers']}: {_tok(x.get('tokens_per_s'))} (steady "
            f"{_tok(x.get('steady_tokens_per_s'))})" for x in sc.runs)
            + (f"; plot {os.path.relpath(sc.plot, ROOT)}" if sc.plot else
               f"; {sc.plot_skipped}" if sc.plot_skipped else ""))
    return lines


def _limit_ratio_lines(r: BenchResults, ra: Ratios) -> list[str]:
    cpus, quick, lines = r.setting.cpus, r.quick, []
    if ra.rates_from == "ours_no_warm_start":
        lines.append("ratios of rates: the workers' run (--no-warm-start); startup and rates "
                     "with startup: the default run")
    if ra.ours_over_cpus_x_limit is not None:
        lines.append(f"ours / ({cpus} x single-core limit) = "
                     f"{fmt_against(ra.ours_over_cpus_x_limit, ra.target_of_limit)} "
                     + _by_run(ra.ours_over_cpus_x_limit_by_run)
                     + f"(target {ra.target_of_limit}: "
                     + ("not judged: --quick runs fewer steps than the chunks made before "
                        "the first batch hold" if quick else _met(ra.meets_target)) + ")"
                     + (f"; our produce / limit = {ra.produce_over_limit:.2f}, ours / ({cpus} x"
                        f" our produce) = {ra.ours_over_cpus_x_produce:.2f}"
                        if ra.produce_over_limit else ""))
    if ra.steady_ours_over_cpus_x_limit is not None and not quick:
        lines.append(f"steady: ours / ({cpus} x single-core limit) = "
                     f"{fmt_against(ra.steady_ours_over_cpus_x_limit, ra.target_of_limit)} "
                     + _by_run(ra.steady_ours_over_cpus_x_limit_by_run)
                     + f"(target {ra.target_of_limit}: {_met(ra.meets_target_steady)}); "
                     f"ours / ({cpus} x our produce) = "
                     f"{ra.steady_ours_over_cpus_x_produce or 0:.2f}")
    if ra.default_run_over_cpus_x_limit is not None and not quick:
        lines.append(f"the default run from its first batch: ours / ({cpus} x single-core "
                     f"limit) = {ra.default_run_over_cpus_x_limit:.2f} (its first rows come "
                     f"from one thread of the host while Ray starts, at low priority after the "
                     f"first batch)")
    if ra.ours_with_startup_over_cpus_x_limit is not None:
        cold = ra.no_warm_start_with_startup_over_cpus_x_limit
        lines.append(f"counting startup: ours / ({cpus} x single-core limit) = "
                     f"{ra.ours_with_startup_over_cpus_x_limit:.2f}"
                     + (f" (--no-warm-start: {cold:.2f})" if cold is not None else ""))
    return lines


def _peer_ratio_lines(r: BenchResults, ra: Ratios) -> list[str]:
    cpus, lines = r.setting.cpus, []
    if ra.ours_over_grain is not None:
        target = ra.target_over_grain
        lines.append(f"ours / best grain on the same tokenizer = "
                     f"{fmt_against(ra.ours_over_grain, target)}"
                     + (f"; steady {fmt_against(ra.steady_ours_over_grain, target)}"
                        if ra.steady_ours_over_grain is not None else "")
                     + f" (target {target}: "
                     + ("not judged: --quick" if r.quick else _met(ra.meets_grain_target)
                        + (f", steady {_met(ra.meets_grain_target_steady)}"
                           if ra.meets_grain_target_steady is not None else "")) + ")"
                     + (f"; at most {ra.grain_ceiling:.2f} here ({cpus} x the tokenizer "
                        f"backend alone / grain)" if ra.grain_ceiling is not None else "")
                     + ("; each pipeline's median ratio to the limit measured on either side "
                        "of its runs" if ra.grain_ratio_from == "ratios to the limit" else ""))
    if ra.best_peer is not None:
        lines.append(f"ours / best peer = {ra.ours_over_best_peer:.2f} ({ra.best_peer}, "
                     f"tokens/s from the first batch"
                     + (f"; left out, no production rate: {', '.join(ra.peers_left_out)}"
                        if ra.peers_left_out else "") + f"); steady: "
                     f"{ra.steady_ours_over_best_peer:.2f} ({ra.steady_best_peer})")
    if ra.best_peer_with_startup is not None:
        lines.append(f"ours / best peer counting startup = "
                     f"{ra.ours_over_best_peer_with_startup:.2f} ({ra.best_peer_with_startup})")
    return lines


def format_table(r: BenchResults) -> str:
    """The results as a plain-text table (the same one RESULTS.md shows)."""
    ra = r.ratios or Ratios(target_of_limit=0.0, target_over_grain=0.0, error="no ratios")
    lines = [*_header(r), *_limit_lines(r), "", *_ours_lines(r), *_peer_lines(r, ra), "",
             *_cpu_table(r), "", *_assembly_lines(r.host_assembly), *_step_lines(r),
             *_limit_ratio_lines(r, ra), *_peer_ratio_lines(r, ra)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m benchmarks.report RESULTS.json", file=sys.stderr)
        return 2
    with open(args[0], encoding="utf-8") as f:
        print(format_table(BenchResults.from_json(json.load(f))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
