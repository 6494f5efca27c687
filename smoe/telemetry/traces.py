"""Synthetic routing traces with controlled locality, as ``RoutingArchive`` (decode only,
one token per batch), for cache-policy studies when no engine archive is at hand.

Model, independently per MoE layer (layers do not influence each other). Every token draws
one Gumbel-max ranking: score(e) = log weight(e) + context(e) + Gumbel noise, with lifts:
- popularity: the expert of popularity rank r has weight (r + 1)^-s (Zipf, s drawn per layer
  in ``zipf`` +- ``zipf_spread``); which experts are popular is a random permutation per layer.
- context (``drift`` > 0): per-expert offsets of the log weight follow a mean-reverting
  random walk (stationary std ``drift``, correlation time ``drift_tokens``): a stand-in for
  the topic, which makes a slowly moving set of experts likely for a while.
- persistence: each of token t's top-k experts is lifted above everyone with probability
  ``keep``, so it stays in t+1's top-k.
- foresight of the gate: each of token t's runners-up (gate ranks k .. 2k-1) is lifted above
  the unlifted experts with probability ``promote``.
The top-k of the scores are the experts used; ranks k .. depth-1 follow in score order, i.e.
drawn without replacement by weight (Gumbel-top-R). ``deep_noise`` blurs the order of those
deeper ranks only (extra Gumbel noise), so they predict the next token less well without
changing what is used.

How the published shares are hit: the adjacent overlap comes from ``keep`` plus chance and
context; reuse within 8 tokens mostly from the context; the current top-2k's coverage of the
next top-k is the overlap plus what ranks k..2k-1 predict, which ``promote`` raises and
``deep_noise`` lowers. ``calibrate`` fits (keep, promote/deep_noise, drift) to three targets
from shared/research/peers.md by measuring generated traces with smoe.telemetry.locality;
tests/unit/test_traces.py checks the presets against them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from smoe.errors import SmoeError
from smoe.telemetry.archive import DECODE, RoutingArchive

_LIFT = 1e6  # far above any log weight + Gumbel noise


@dataclass(frozen=True)
class TraceParams:
    num_experts: int = 128
    top_k: int = 8
    layers: int = 48
    zipf: float = 0.8  # mean popularity exponent s
    zipf_spread: float = 0.0  # per-layer s uniform in [zipf - spread, zipf + spread]
    keep: float = 0.4  # P(an expert of top_k(t) stays in top_k(t+1))
    promote: float = 0.0  # P(an expert of t's gate ranks k..2k-1 enters top_k(t+1))
    deep_noise: float = 0.0  # extra Gumbel noise (scale) on the order of ranks k..depth-1
    drift: float = 0.0  # stationary std of log-popularity offsets (0: fixed popularity)
    drift_tokens: float = 256.0  # their correlation time, in tokens
    depth: int = 32  # gate ranks stored per token and layer
    record_bytes: int = 0  # bytes of one expert record of the modelled model (for reports)

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise SmoeError(
                f"trace needs 0 < top_k <= num_experts, not {self.top_k}/{self.num_experts}"
            )
        if not 0.0 <= self.keep <= 1.0 or not 0.0 <= self.promote <= 1.0:
            raise SmoeError("trace parameters keep and promote are probabilities: 0..1")


# Calibrated with calibrate(TraceParams(zipf=0.8, zipf_spread=0.3, drift_tokens=256),
# TARGETS[name], tokens=4000, layers=16); zipf, zipf_spread and drift_tokens are assumptions
# (no published figure pins them down; docs/cache-policy.md shows how much they matter).
PRESETS: dict[str, TraceParams] = {
    # Qwen3-235B-A22B: 94 MoE layers, 128 experts, top-8, 4-bit records of 10.1 MiB.
    "qwen3-235b-like": TraceParams(
        layers=94,
        zipf=0.8,
        zipf_spread=0.3,
        keep=0.085,
        deep_noise=0.5724,
        drift=2.21,
        drift_tokens=256,
        record_bytes=10_616_832,
    ),
    # Qwen3-30B-A3B: 48 MoE layers, 128 experts, top-8, 4-bit records of 2.5 MiB.
    "qwen3-30b-like": TraceParams(
        layers=48,
        zipf=0.8,
        zipf_spread=0.3,
        keep=0.0344,
        deep_noise=0.4744,
        drift=2.2526,
        drift_tokens=256,
        record_bytes=2_654_208,
    ),
}

# What each preset was calibrated to (locality.headline() names). Published: adjacent reuse
# 46.4% and top-16 covering 63.7% of the next top-8 on Qwen3-235B (S-MoE); 45% adjacent and
# 80% within 8 tokens on Qwen3-30B-A3B. Assumed: the other model's figure for the missing ones.
TARGETS: dict[str, dict[str, float]] = {
    "qwen3-235b-like": {"overlap": 0.464, "cover_2k": 0.637, "reuse_8": 0.80},
    "qwen3-30b-like": {"overlap": 0.45, "cover_2k": 0.637, "reuse_8": 0.80},
}


def generate(
    params: TraceParams, tokens: int, *, seed: int = 0, name: str = "synthetic"
) -> RoutingArchive:
    """A decode-only archive of ``tokens`` tokens: ranks [tokens, layers, depth] uint16,
    one token per batch. Deterministic in (params, tokens, seed)."""
    p = params
    rng = np.random.default_rng(seed)
    num_layers, e, k = p.layers, p.num_experts, p.top_k
    depth = max(min(p.depth, e), min(2 * k, e))
    s = p.zipf + p.zipf_spread * rng.uniform(-1.0, 1.0, num_layers)
    base = -s[:, None] * np.log(np.arange(1, e + 1))[None, :]  # by popularity rank
    perm = np.argsort(rng.random((num_layers, e)), axis=1)  # expert at each rank
    logw = np.empty_like(base)
    np.put_along_axis(logw, perm, base, axis=1)  # [L, E] log weight per expert
    a = float(np.exp(-1.0 / p.drift_tokens)) if p.drift else 0.0
    offset = p.drift * rng.standard_normal((num_layers, e)) if p.drift else None
    rows = np.arange(num_layers)[:, None]
    ranks = np.empty((tokens, num_layers, depth), np.uint16)
    prev: np.ndarray | None = None  # [L, depth] ranking of the previous token
    for t in range(tokens):
        score = logw + rng.gumbel(size=(num_layers, e))
        if offset is not None:
            offset = a * offset + np.sqrt(1 - a * a) * p.drift * rng.standard_normal(offset.shape)
            score += offset
        if prev is not None:
            runners = prev[:, k : 2 * k]
            lift = np.where(rng.random(runners.shape) < p.promote, _LIFT, 0.0)
            np.add.at(score, (np.broadcast_to(rows, runners.shape), runners), lift)
            top = prev[:, :k]
            lift = np.where(rng.random(top.shape) < p.keep, 2 * _LIFT, 0.0)
            np.add.at(score, (np.broadcast_to(rows, top.shape), top), lift)
        order = np.argsort(-score, axis=1, kind="stable")[:, :depth]
        if p.deep_noise:  # blur ranks k.. only: the top-k (what is used) stays as drawn
            top = order[:, :k]
            noisy = score + p.deep_noise * rng.gumbel(size=score.shape)
            np.put_along_axis(noisy, top, 4 * _LIFT + np.take_along_axis(score, top, 1), 1)
            order = np.argsort(-noisy, axis=1, kind="stable")[:, :depth]
        ranks[t] = order
        prev = order
    meta: dict[str, Any] = {
        "source": name,
        "synthetic": asdict(p) | {"tokens": tokens, "seed": seed},
        "depth": depth,
    }
    if p.record_bytes:
        meta["record_bytes"] = p.record_bytes
    return RoutingArchive(
        e,
        k,
        list(range(num_layers)),
        ranks,
        np.arange(tokens, dtype=np.int32),
        np.full(tokens, DECODE, np.uint8),
        meta,
    )


def preset_trace(
    name: str, tokens: int, *, seed: int = 0, layers: int | None = None, **overrides: Any
) -> RoutingArchive:
    """``generate`` with a preset's parameters (``layers`` and any field overridable)."""
    try:
        params = PRESETS[name]
    except KeyError:
        raise SmoeError(
            f"unknown trace preset '{name}'; choose one of {', '.join(sorted(PRESETS))}"
        ) from None
    if layers is not None:
        overrides["layers"] = layers
    unknown = set(overrides) - set(asdict(params))
    if unknown:
        raise SmoeError(
            f"trace parameter {sorted(unknown)[0]!r} does not exist; use one of "
            f"{', '.join(sorted(asdict(params)))}"
        )
    return generate(replace(params, **overrides), tokens, seed=seed, name=name)


def measure(
    params: TraceParams, tokens: int = 6000, *, layers: int = 16, seed: int = 0
) -> dict[str, float]:
    """Headline locality figures of a generated trace (see locality.headline)."""
    from smoe.telemetry.locality import headline, locality

    arch = generate(replace(params, layers=layers), tokens, seed=seed)
    return headline(locality(arch, windows=(1, 8), depths=(params.top_k, 2 * params.top_k)))


# (parameter, statistic it controls, search range): each statistic rises with its parameter.
# "foresight" is signed: f >= 0 sets promote = f, f < 0 sets deep_noise = -f (promote 0), so
# one monotone knob can raise or lower how much the deeper ranks predict.
CALIBRATION_KNOBS: tuple[tuple[str, str, float, float], ...] = (
    ("keep", "overlap", 0.0, 1.0),
    ("foresight", "cover_2k", -8.0, 1.0),
    ("drift", "reuse_8", 0.0, 6.0),
)


def _with(params: TraceParams, name: str, value: float) -> TraceParams:
    if name == "foresight":
        return replace(params, promote=max(value, 0.0), deep_noise=max(-value, 0.0))
    changes: dict[str, Any] = {name: value}
    return replace(params, **changes)


def calibrate(
    params: TraceParams,
    targets: dict[str, float],
    *,
    tokens: int = 6000,
    layers: int = 16,
    iterations: int = 8,
    tolerance: float = 0.002,
    seed: int = 0,
    knobs: Sequence[tuple[str, str, float, float]] = CALIBRATION_KNOBS,
    log: Callable[[str], None] | None = None,
) -> TraceParams:
    """Fit each knob (parameter, statistic, low, high) to its target: by default ``keep``
    to targets["overlap"], ``promote``/``deep_noise`` to targets["cover_2k"] and ``drift``
    to targets["reuse_8"]. Damped Newton steps on a finite-difference Jacobian, clipped to
    the ranges (the statistics interact: drift raises the overlap as much as keep does);
    stops when every statistic is within ``tolerance``. Common random numbers (one seed)
    keep the measured functions smooth."""
    use = [(n, st, lo, hi) for n, st, lo, hi in knobs if st in targets]
    x = np.array([_value(params, n) for n, *_ in use], float)
    lo = np.array([k[2] for k in use])
    hi = np.array([k[3] for k in use])
    want = np.array([targets[k[1]] for k in use])

    def stats(v: np.ndarray) -> np.ndarray:
        p = params
        for (name, *_), value in zip(use, v, strict=True):
            p = _with(p, name, float(value))
        got = measure(p, tokens, layers=layers, seed=seed)
        return np.array([got[k[1]] for k in use])

    for _ in range(iterations):
        y = stats(x)
        if log is not None:
            log(f"{dict(zip([k[0] for k in use], x.round(4), strict=True))} -> {y.round(4)}")
        if np.all(np.abs(y - want) <= tolerance):
            break
        step = 0.02 * (hi - lo)
        jac = np.empty((len(use), len(use)))
        for j in range(len(use)):
            h = step[j] if x[j] + step[j] <= hi[j] else -step[j]
            dx = x.copy()
            dx[j] += h
            jac[:, j] = (stats(dx) - y) / h
        move = np.linalg.lstsq(jac, want - y, rcond=None)[0]
        move = np.clip(move, -0.25 * (hi - lo), 0.25 * (hi - lo))  # damped: stay local
        x = np.clip(x + move, lo, hi)
    for (name, *_), value in zip(use, x, strict=True):
        params = _with(params, name, round(float(value), 4))
    return params


def _value(params: TraceParams, name: str) -> float:
    if name == "foresight":
        return params.promote if params.promote > 0 else -params.deep_noise
    return float(getattr(params, name))
