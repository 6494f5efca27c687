"""Routing locality of an archive: how much of a token's expert set the recent past predicts.

All statistics are over consecutive tokens of one phase (decode by default) in archive
order; a token and its predecessor must both be in that phase (a prefill between two
generations breaks the chain). Per layer, then "overall" = mean over layers (every layer
has the same number of token pairs). Definitions, with E_t = top_k(t) the experts token t
used at a layer:

- adjacent overlap: |E_t & E_{t+1}| / k  (= reuse within 1 token);
- reuse within W: share of E_{t+1} that appears in E_{t-W+1} | ... | E_t, over tokens with at
  least W predecessors in the run;
- coverage by top-k': |top_k'(t) & E_{t+1}| / k for k' = k, 2k, 4k, ... up to the archive's
  depth: how much of the next token a prefetch of the current token's k' best-gated experts
  would have covered;
- popularity: share of all E_t picks taken by the 10% / 25% most used experts of the layer.
Everything returned is JSON-able (floats, ints, lists, string keys).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from smoe.telemetry.archive import DECODE, RoutingArchive


def _runs(archive: RoutingArchive, phase: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(in_phase [N] bool, start [N] int: index of the first token of each token's run)."""
    n = archive.num_tokens
    keep = np.ones(n, bool) if phase is None else archive.phase == phase
    first = keep & ~np.concatenate(([False], keep[:-1]))
    start = np.maximum.accumulate(np.where(first, np.arange(n), 0)) if n else np.zeros(0, int)
    return keep, start


def _onehot(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """[N, j] expert ids -> [N, num_experts] bool presence."""
    out = np.zeros((ids.shape[0], num_experts), bool)
    np.put_along_axis(out, ids.astype(np.int64), True, axis=1)
    return out


def _summary(per_layer: list[float]) -> dict[str, Any]:
    return {
        "overall": float(np.mean(per_layer)) if per_layer else 0.0,
        "per_layer": [round(float(v), 6) for v in per_layer],
    }


def _coverage_depths(top_k: int, depth: int) -> list[int]:
    out, d = [], top_k
    while d <= depth:
        out.append(d)
        d *= 2
    if depth > top_k and out[-1] != depth:
        out.append(depth)
    return out


def locality(
    archive: RoutingArchive,
    *,
    windows: Sequence[int] = (1, 2, 4, 8, 16),
    depths: Sequence[int] | None = None,
    phase: int | None = DECODE,
) -> dict[str, Any]:
    """Locality statistics of ``archive`` (see the module docstring), as a JSON-able dict:
    ``adjacent_overlap``, ``reuse_within[str(W)]``, ``coverage[str(k')]`` and
    ``popularity[...]``, each {"overall": float, "per_layer": [float per MoE layer]}."""
    k, e_count = archive.top_k, archive.num_experts
    windows = sorted({1, *windows})  # 1 is the adjacent overlap
    depths = list(depths) if depths is not None else _coverage_depths(k, archive.depth)
    depths = [d for d in depths if k <= d <= archive.depth]
    in_phase, start = _runs(archive, phase)
    n = archive.num_tokens
    u = np.arange(1, n)
    pair = in_phase[1:] & in_phase[:-1]  # (u-1, u) both in the phase: u predicts from u-1
    targets = u[pair]
    reuse: dict[int, list[float]] = {w: [] for w in windows}
    cover: dict[int, list[float]] = {d: [] for d in depths}
    top10: list[float] = []
    top25: list[float] = []
    for pos in range(len(archive.layers)):
        ranks = archive.ranks[:, pos, :].astype(np.int64)
        top = ranks[:, :k]
        present = _onehot(top, e_count)
        # last[t, e]: the latest token <= t whose top-k held e (-1: none yet)
        last = np.maximum.accumulate(
            np.where(present, np.arange(n, dtype=np.int64)[:, None], -1), axis=0
        )
        if targets.size:
            dist = targets[:, None] - np.take_along_axis(last[targets - 1], top[targets], 1)
            for w in windows:
                ok = targets - start[targets] >= w  # w predecessors inside the run
                reuse[w].append(float((dist[ok] <= w).mean()) if ok.any() else 0.0)
            for d in depths:
                deep = _onehot(ranks[targets - 1, :d], e_count)
                cover[d].append(float(np.take_along_axis(deep, top[targets], 1).mean()))
        picks = np.sort(np.bincount(top[in_phase].ravel(), minlength=e_count))[::-1]
        total = max(1, int(picks.sum()))
        top10.append(float(picks[: max(1, e_count // 10)].sum() / total))
        top25.append(float(picks[: max(1, e_count // 4)].sum() / total))
    return {
        "num_experts": e_count,
        "top_k": k,
        "depth": archive.depth,
        "layers": len(archive.layers),
        "tokens": int(in_phase.sum()),
        "pairs": int(targets.size),
        "phase": "all" if phase is None else ("decode" if phase == DECODE else "prefill"),
        "adjacent_overlap": _summary(reuse.get(1, [])),
        "reuse_within": {str(w): _summary(v) for w, v in reuse.items()},
        "coverage": {str(d): _summary(v) for d, v in cover.items()},
        "popularity": {"top10pct_share": _summary(top10), "top25pct_share": _summary(top25)},
    }


def headline(report: dict[str, Any]) -> dict[str, float]:
    """The few overall figures of a ``locality`` report, flat (for tables and tests)."""
    k = report["top_k"]
    out = {f"reuse_{w}": v["overall"] for w, v in report["reuse_within"].items()}
    out["overlap"] = report["adjacent_overlap"]["overall"]
    for d, v in report["coverage"].items():
        out[f"cover_{int(d) // k}k"] = v["overall"]
    out["top25_share"] = report["popularity"]["top25pct_share"]["overall"]
    return out
