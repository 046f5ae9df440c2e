"""The results of one ``ingest bench`` run as typed records; JSON only at the file's boundary.

``BenchResults.from_json`` reads a results file (the stored benchmarks/results*.json too) and
``to_json`` writes the same keys back: each record types the figures the harness computes
with, and keeps whatever else a measured program reported (memory samples, profiles, a
peer's burst figures) in ``details``, as the program wrote it. A figure that was not measured
is ``None`` and absent from the JSON.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Self

__all__ = ["BenchResults", "Limits", "Machine", "Ratios", "Scaling", "Section", "Setting",
           "WorkerRun"]


class _Flat:
    """JSON for a record whose fields are plain values: a ``None`` field is left out, and the
    keys it does not name go to and come from ``details``."""

    details: dict[str, Any]

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Self:
        if not isinstance(d, dict):
            raise TypeError(f"{cls.__name__}: expected a JSON object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)} - {"details"}
        return cls(**{k: v for k, v in d.items() if k in names},
                   details={k: v for k, v in d.items() if k not in names})

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "details" and getattr(self, f.name) is not None}
        return {**out, **self.details}


@dataclasses.dataclass(kw_only=True)
class Section(_Flat):
    """One measured program's figures (rates in tokens/s, times in seconds), or its error."""

    error: str | None = None
    command: str | None = None
    steps: int | None = None
    tokens: int | None = None
    tokens_per_s: float | None = None
    steady_tokens_per_s: float | None = None
    tokens_per_s_with_startup: float | None = None
    startup_s: float | None = None
    wall_s: float | None = None
    # ingest run's time per batch, from the first batch and over the run's later part
    seconds_per_batch: float | None = None
    steady_seconds_per_batch: float | None = None
    stall_fraction: float | None = None
    # A run between two measures of the tokenizer's limit (tokens/s), and of a pipeline run
    # several times, every run's rate and ratio to the limit (``benchmarks.ratios.median_run``).
    limit_before: float | None = None
    limit_after: float | None = None
    runs_tokens_per_s: list[float | None] | None = None
    over_limit_by_run: list[float] | None = None
    steady_over_limit_by_run: list[float] | None = None
    over_limit: float | None = None
    steady_over_limit: float | None = None
    bursty: bool | None = None  # a peer's batches came in bursts (``benchmarks.peers``)
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def measured(self) -> bool:
        """Whether the program made batches (a rate), not an error or a skip."""
        return self.tokens_per_s is not None

    @property
    def memory(self) -> dict[str, Any]:
        """The process tree's memory and CPU (``benchmarks.measure``); {} where not sampled."""
        return self.details.get("memory") or {}

    @property
    def steady_or_rate(self) -> float:
        """The steady rate, or the rate from the first batch where the run had no steady
        part."""
        assert self.tokens_per_s is not None, "no rate: check `measured` first"
        return self.steady_tokens_per_s or self.tokens_per_s


@dataclasses.dataclass(kw_only=True)
class WorkerRun:
    """One workers' run (``--no-warm-start``) between two measures of the tokenizer's limit
    (tokens/s; None where that measure failed)."""

    limit_before: float | None
    limit_after: float | None
    tokens_per_s: float | None = None
    steady_tokens_per_s: float | None = None
    error: str | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> WorkerRun:
        return cls(**d)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return {k: v for k, v in out.items() if v is not None or k.startswith("limit_")}


@dataclasses.dataclass(kw_only=True)
class Limits:
    """The single-core measures (``benchmarks.limit``)."""

    tokenizer: Section
    feed_backend: Section
    other_backend: Section
    parquet: Section
    produce: Section
    tokenizer_after_ours: Section | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Limits:
        return cls(**{k: Section.from_json(v) for k, v in d.items()})

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name).to_json() for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}


@dataclasses.dataclass(kw_only=True)
class Machine(_Flat):
    cpus: int
    cpu_model: str = ""
    memory_bytes: int | None = None
    platform: str | None = None
    python: str | None = None
    load_average_start: list[float] | None = None
    load_average_end: list[float] | None = None
    # None in files written before it was measured: the table falls back on the load average.
    busy_cpus_start: float | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(kw_only=True)
class Setting(_Flat):
    """What was measured: the corpus, tokenizer, shapes, and the run's resolved knobs."""

    config: str
    files: list[str]
    tokenizer: str
    seq_len: int
    global_batch_size: int
    cpus: int
    steps: int | str  # "every epoch" where the run reads the whole corpus
    epochs: int = 1
    tokenizer_backend: str | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(kw_only=True)
class Scaling(_Flat):
    """``ingest run --workers W`` over the sweep, or why it did not run."""

    skipped: str | None = None
    cpus: int | None = None
    runs: list[dict[str, Any]] | None = None  # {"workers": W, rates or "error"}
    single_core_limit_tokens_per_s: float | None = None
    plot: str | None = None
    plot_skipped: str | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


# Verdicts that a --quick run leaves unjudged: written as null next to the ratio they judge.
_VERDICTS = {"meets_target": "ours_over_cpus_x_limit",
             "meets_target_steady": "steady_ours_over_cpus_x_limit",
             "meets_grain_target": "ours_over_grain",
             "meets_grain_target_steady": "steady_ours_over_grain"}


@dataclasses.dataclass(kw_only=True)
class Ratios(_Flat):
    """Ours against the limit and the peers (``benchmarks.ratios``); ``*_by_run``: each
    workers' run's, of which the figure is the median."""

    target_of_limit: float
    target_over_grain: float
    error: str | None = None
    rates_from: str | None = None
    worker_runs: int | None = None
    ours_over_cpus_x_limit: float | None = None
    steady_ours_over_cpus_x_limit: float | None = None
    ours_over_cpus_x_limit_by_run: list[float] | None = None
    steady_ours_over_cpus_x_limit_by_run: list[float] | None = None
    meets_target: bool | None = None
    meets_target_steady: bool | None = None
    ours_with_startup_over_cpus_x_limit: float | None = None
    no_warm_start_with_startup_over_cpus_x_limit: float | None = None
    default_run_over_cpus_x_limit: float | None = None
    limit_drift: float | None = None
    produce_over_limit: float | None = None
    ours_over_cpus_x_produce: float | None = None
    steady_ours_over_cpus_x_produce: float | None = None
    grain_ratio_from: str | None = None
    ours_over_grain: float | None = None
    steady_ours_over_grain: float | None = None
    meets_grain_target: bool | None = None
    meets_grain_target_steady: bool | None = None
    grain_ceiling: float | None = None
    ours_over_each_peer: dict[str, float] | None = None
    ours_over_each_peer_with_startup: dict[str, float] | None = None
    peers_left_out: list[str] | None = None
    best_peer: str | None = None
    ours_over_best_peer: float | None = None
    steady_best_peer: str | None = None
    steady_ours_over_best_peer: float | None = None
    best_peer_with_startup: str | None = None
    ours_over_best_peer_with_startup: float | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        out.update({v: None for v, ratio in _VERDICTS.items()
                    if v not in out and getattr(self, ratio) is not None})
        return out


@dataclasses.dataclass(kw_only=True)
class BenchResults:
    """Every section of one run (``benchmarks.bench.SECTIONS`` names them in the JSON)."""

    version: int
    mode: str  # "full" or "quick"
    command: str
    created: str
    machine: Machine
    versions: dict[str, str]
    setting: Setting
    limit: Limits
    ours: Section
    ours_no_warm_start: Section | None = None
    worker_runs: list[WorkerRun] = dataclasses.field(default_factory=list)
    training_step: Section | None = None
    training_step_no_warm_start: Section | None = None
    scaling: Scaling | None = None
    peers: dict[str, Section] = dataclasses.field(default_factory=dict)
    host_assembly: Section | None = None
    ratios: Ratios | None = None

    @property
    def quick(self) -> bool:
        return self.mode == "quick"

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BenchResults:
        """Reads a results file's object; a missing section raises KeyError naming it."""
        opt = {k: Section.from_json(d[k]) for k in
               ("ours_no_warm_start", "training_step", "training_step_no_warm_start",
                "host_assembly") if k in d}
        return cls(version=d["version"], mode=d["mode"], command=d["command"],
                   created=d["created"], machine=Machine.from_json(d["machine"]),
                   versions=dict(d["versions"]), setting=Setting.from_json(d["setting"]),
                   limit=Limits.from_json(d["limit"]), ours=Section.from_json(d["ours"]),
                   worker_runs=[WorkerRun.from_json(r) for r in d.get("worker_runs", ())],
                   scaling=Scaling.from_json(d["scaling"]) if "scaling" in d else None,
                   peers={k: Section.from_json(v) for k, v in d.get("peers", {}).items()},
                   ratios=Ratios.from_json(d["ratios"]) if "ratios" in d else None, **opt)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.version, "mode": self.mode,
                               "command": self.command, "created": self.created,
                               "versions": self.versions,
                               "worker_runs": [r.to_json() for r in self.worker_runs],
                               "peers": {k: v.to_json() for k, v in self.peers.items()}}
        for name in ("machine", "setting", "limit", "ours", "ours_no_warm_start",
                     "training_step", "training_step_no_warm_start", "scaling",
                     "host_assembly", "ratios"):
            if (value := getattr(self, name)) is not None:
                out[name] = value.to_json()
        return out
