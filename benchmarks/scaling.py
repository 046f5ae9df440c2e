"""Tokens/s against worker count: the points ``ingest bench`` runs, and the plot (PNG).

The plot needs matplotlib (``pip install -e '.[bench]'``); without it the figures are still in
the results file and the table.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["plot", "sweep_points"]


def sweep_points(cpus: int) -> list[int]:
    """Worker counts to run: 1, 2, 4, ... up to ``cpus``, and ``cpus`` itself."""
    points, w = [], 1
    while w < cpus:
        points.append(w)
        w *= 2
    return [*points, cpus]


def plot(scaling: dict[str, Any], path: str, *, title: str = "") -> str | None:
    """Writes tokens/s against workers to ``path``; returns why not if it could not."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: write files only
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: pip install -e '.[bench]' for the plot"
    runs = [r for r in scaling["runs"] if "tokens_per_s" in r]
    if not runs:
        return "no run of the sweep succeeded"
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    workers = [r["workers"] for r in runs]
    ax.plot(workers, [r["tokens_per_s"] / 1e6 for r in runs], "o-",
            label="ours, from the first batch")
    steady = [(r["workers"], r["steady_tokens_per_s"] / 1e6) for r in runs
              if r.get("steady_tokens_per_s")]
    if steady:
        ax.plot(*zip(*steady, strict=True), "s--", label="ours, steady")
    # The ceilings measured on W cores at once, one pinned process per core, no Ray
    # (``benchmarks.worker_sweep``): what the machine's cores give together.
    for key, label, style in (("tokenizer_on_w_cores_tokens_per_s",
                               "tokenizer alone, one process per core", "^-."),
                              ("produce_on_w_cores_tokens_per_s",
                               "our produce alone, one process per core", "v-.")):
        alone = [(r["workers"], r[key] / 1e6) for r in runs if r.get(key)]
        if alone:
            ax.plot(*zip(*alone, strict=True), style, alpha=0.7, label=label)
    limit = scaling.get("single_core_limit_tokens_per_s")
    cpus = scaling["cpus"]
    if limit:
        xs = list(range(1, max(workers) + 1))
        ax.plot(xs, [min(x, cpus) * limit / 1e6 for x in xs], ":", color="gray",
                label="min(workers, CPUs) x single-core tokenizer")
    ax.set_xlabel("workers")
    ax.set_ylabel("M tokens/s")
    ax.set_xticks(workers)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(title or f"ingest run on {cpus} CPUs", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return None
