"""`smoe bench policy`'s report as Markdown tables (smoe.bench.policy.bench_policy's dict):
per ring size, each policy's misses against Belady's; Belady with limited foresight; the
prefetch lines."""

from __future__ import annotations

from typing import Any


def format_table(report: dict[str, Any]) -> str:
    """Markdown: one row per ring size; per policy, misses and misses / Belady's. Then, if
    present, Belady with limited foresight, and the prefetch lines (one row each)."""
    rings = report["rings"]
    names = list(rings[0]["policies"]) if rings else []
    head = ["ring", "slots", "Belady misses (hit)"] + [f"{n} (x Belady)" for n in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rings:
        b = r["belady"]
        cells = [
            f"{r['fraction']:.0%}",
            f"{r['slots']:,}",
            f"{b['misses']:,} ({b['hit_rate']:.1%})",
        ]
        for n in names:
            p = r["policies"][n]
            ratio = p["vs_belady"]
            cells.append(f"{p['misses']:,} ({ratio:.3f})" if ratio else f"{p['misses']:,}")
        lines.append("| " + " | ".join(cells) + " |")
    horizons = list(rings[0].get("belady_horizon", {})) if rings else []
    if horizons:  # a second table: Belady with limited foresight
        head = ["ring"] + [f"Belady, {h} tokens of foresight (x Belady)" for h in horizons]
        lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rings:
            cells = [f"{r['fraction']:.0%}"] + [
                f"{r['belady_horizon'][h]['misses']:,} ({r['belady_horizon'][h]['vs_belady']:.3f})"
                for h in horizons
            ]
            lines.append("| " + " | ".join(cells) + " |")
    foresight = list(rings[0].get("foresight", {})) if rings else []
    if foresight:  # prefetch lines: demand misses, then every read (speculative included)
        head = ["prefetch line"] + [
            f"{r['fraction']:.0%} ring: misses (x Belady) / reads (x Belady)" for r in rings
        ]
        lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for n in foresight:
            cells = [n]
            for r in rings:
                p = r["foresight"][n]
                if p["vs_belady"] is None:
                    cells.append(f"{p['misses']:,} / {p['reads']:,}")
                else:
                    cells.append(
                        f"{p['misses']:,} ({p['vs_belady']:.3f}) / "
                        f"{p['reads']:,} ({p['reads_vs_belady']:.3f})"
                    )
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
