"""Figures for benchmark reports (PNG). matplotlib is optional: `pip install "smoe[plot]"`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from smoe.errors import SmoeError


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SmoeError('plots need matplotlib: pip install "smoe[plot]"') from None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_hit_rates(report: dict[str, Any], path: str | Path) -> Path:
    """Hit rate vs ring size (fraction of the working set), one line per policy and
    Belady's optimum dashed, from a ``bench_policy`` report."""
    plt = _pyplot()
    rings = sorted(report["rings"], key=lambda r: r["fraction"])
    if not rings:
        raise SmoeError("the report has no ring sizes to plot")
    x = [100 * r["fraction"] for r in rings]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in rings[0]["policies"]:
        ax.plot(x, [100 * r["policies"][name]["hit_rate"] for r in rings], marker="o", label=name)
    ax.plot(
        x,
        [100 * r["belady"]["hit_rate"] for r in rings],
        "k--",
        marker="s",
        label="Belady (optimal)",
    )
    trace = report.get("trace", {})
    ax.set_title(
        f"{trace.get('source', 'trace')}: {trace.get('requests', 0):,} requests, "
        f"working set {trace.get('working_set', 0):,}",
        fontsize=10,
    )
    ax.set_xlabel("ring size (% of the working set)")
    ax.set_ylabel("hit rate (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_time_breakdown(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Stacked bars of per-token time (compute, I/O wait, other; seconds) per memory budget.
    ``rows``: dicts with keys budget (label or number), compute_s, io_wait_s, other_s."""
    plt = _pyplot()
    if not rows:
        raise SmoeError("no rows to plot")
    labels = [str(r["budget"]) for r in rows]
    parts = [
        ("compute_s", "compute", "#4c72b0"),
        ("io_wait_s", "I/O wait", "#dd8452"),
        ("other_s", "other", "#999999"),
    ]
    fig, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(rows) + 2), 4.2))
    bottom = [0.0] * len(rows)
    for key, label, color in parts:
        ms = [1e3 * float(r.get(key, 0.0)) for r in rows]
        ax.bar(labels, ms, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, ms, strict=True)]
    ax.set_xlabel("memory budget")
    ax.set_ylabel("time per token (ms)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
