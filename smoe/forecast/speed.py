"""`smoe plan`'s speed model: hit rates from routing curves, then decode and prefill
tok/s bands and the cold-fill time from the disk and compute probes (smoe.io.disk_probe,
smoe.forecast.probe).
Pure arithmetic (numpy); every formula is in docs/plan.md.

Notation: L MoE layers of E experts, top-k per token, B bytes per record read, S ring
slots, q[l, e] the probability that a token routes to expert e at layer l.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from smoe.telemetry.traces import PRESETS, TARGETS

# Published routing figures (smoe.telemetry.traces, docs/cache-policy.md): Zipf exponent of
# expert popularity (assumed) and the share of a token's experts the next token reuses.
PUBLISHED = "qwen3-235b-like"
ZIPF = PRESETS[PUBLISHED].zipf
ADJACENT_REUSE = TARGETS[PUBLISHED]["overlap"]
# Lookahead (on by default) prefetches the next layer's experts its router predicts from
# this layer's input; 66.8% of them are right on the demo (docs/speculation.md). A wrong
# one is a read of an expert the token does not use: the band's recall is 50% - 80%.
LOOKAHEAD_RECALL = (0.5, 0.8)


@dataclass(frozen=True)
class Shape:
    """The routed part of a model, as the forecast needs it."""

    layers: int  # MoE layers
    experts: int  # per layer
    top_k: int
    record_bytes: int  # bytes read per expert (the record stride)

    @property
    def records(self) -> int:
        return self.layers * self.experts


def routing_probabilities(shape: Shape, counts: np.ndarray | None) -> tuple[np.ndarray, str]:
    """q [L, E]: each expert's chance to be in a token's top-k, from the vault's popularity
    counts when it has any for every layer, else from the published Zipf curve (the same
    for every layer). Returns (q, source)."""
    k, e = shape.top_k, shape.experts
    if counts is not None and counts.shape == (shape.layers, e) and (counts.sum(1) > 0).all():
        q = k * counts / counts.sum(1, keepdims=True)
        source = f"vault popularity ({int(counts.sum() / k / shape.layers)} tokens)"
    else:
        w = np.arange(1, e + 1, dtype=np.float64) ** -ZIPF
        q = np.tile(k * w / w.sum(), (shape.layers, 1))
        source = f"published locality (Zipf {ZIPF}, adjacent reuse {ADJACENT_REUSE})"
    return np.minimum(q, 1.0), source


def hit_rates(shape: Shape, q: np.ndarray, slots: int) -> tuple[float, float]:
    """(low, high) decode hit rate of a ring of ``slots``. Low: the ring keeps the S
    experts most likely to be routed (what a frequency cache converges to). High: also the
    previous token's experts, of which the next token reuses ADJACENT_REUSE, in the share
    of a token's L x k experts the ring can hold."""
    if slots >= shape.records:
        return 1.0, 1.0
    per_token = shape.layers * shape.top_k
    static = float(np.sort(q, axis=None)[::-1][:slots].sum() / per_token)
    recent = ADJACENT_REUSE * min(1.0, slots / per_token)
    return static, static + (1 - static) * recent


def chunk_union(q: np.ndarray, tokens: int) -> float:
    """Expected distinct experts a prefill chunk of ``tokens`` tokens routes to, summed
    over layers: sum of 1 - (1 - q)^tokens."""
    return float((1 - (1 - q) ** tokens).sum())


def serial_read_s(reads: float, layers: int, workers: int, record_bytes: int, bw: float) -> float:
    """Seconds the compute waits for ``reads`` reads spread over ``layers`` layers when it
    waits for each layer's last: a layer's reads go out together, ``workers`` at a time,
    and each takes ``workers * record_bytes / bw`` (the probe's rate is that of ``workers``
    reads in flight), so a layer waits ceil(reads per layer / workers) such rounds."""
    if reads <= 0:
        return 0.0
    rounds = math.ceil(reads / layers / workers - 1e-9)
    return layers * rounds * workers * record_bytes / bw


# Student's t, 97.5th percentile, by degrees of freedom (a 95% two-sided interval)
_T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def prediction_band(values: list[float]) -> tuple[float, float]:
    """Where the next measurement of what ``values`` (positive times) sampled falls, 95% of
    the time: the prediction interval mean +- t * sd * sqrt(1 + 1/n) of their logarithms,
    widened to the samples' range (their own min and max would miss a new one 2 / (n + 1)
    of the time) and kept within a factor 2 of it. In logarithms because timing noise is
    multiplicative: a band in seconds could reach 0, and its inverse (tok/s) infinity."""
    if not values:
        return float("nan"), float("nan")
    n = len(values)
    if n < 2:
        return values[0], values[0]
    logs = [math.log(max(v, 1e-12)) for v in values]
    mean = sum(logs) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in logs) / (n - 1))
    half = _T975.get(n - 1, 2.0) * sd * math.sqrt(1 + 1 / n)
    # A few noisy samples give a t-band of orders of magnitude: keep it within a factor 2
    # of the samples' range (the probe's figures are what was seen, not a guess).
    low = max(math.exp(mean - half), min(values) / 2)
    high = min(math.exp(mean + half), 2 * max(values))
    return min(min(values), low), max(max(values), high)


def forecast(
    shape: Shape,
    slots: int,
    q: np.ndarray,
    disk: dict[str, Any],
    compute: dict[str, Any],
    chunk: int = 64,
    workers: int = 4,
) -> dict[str, Any]:
    """Decode and prefill tok/s bands, hit rates, misses per token and the cold-fill time
    of a ring of ``slots`` (docs/plan.md). ``disk``: smoe.io.disk_probe.probe_disk's GB/s (low, median,
    high); ``compute``: probe_compute's seconds per decode token and per prefill token;
    ``workers``: the engine's I/O threads. The probe's measured decode hit rates, reads
    per decoded token and per prefill chunk (at this ring, where recorded) widen the
    modelled bands."""
    b = shape.record_bytes
    bw_lo, bw, bw_hi = (disk[k] * 1e9 for k in ("gbps_low", "gbps", "gbps_high"))
    c_lo, c_hi = prediction_band(compute["decode_s"])
    p_lo, p_hi = prediction_band(compute["prefill_token_s"])
    h_lo, h_hi = hit_rates(shape, q, slots)
    seen = compute.get("decode_hit_rate") or []  # measured by the probe at this ring
    if seen and slots < shape.records:  # a routing that repeats itself beats the curves
        h_lo, h_hi = min(h_lo, min(seen)), max(h_hi, max(seen))
    per_token = shape.layers * shape.top_k
    absent = max(0.0, 1 - slots / shape.records)  # chance a wrong guess is not resident
    miss_hi = per_token * ((1 - h_lo) + (1 - LOOKAHEAD_RECALL[0]) * absent)
    miss_lo = per_token * ((1 - h_hi) + (1 - LOOKAHEAD_RECALL[1]) * absent)
    read = compute.get("decode_reads_per_token") or []  # measured by the probe, likewise
    if read and slots < shape.records:
        miss_lo, miss_hi = min(miss_lo, min(read)), max(miss_hi, max(read))
    # slow: the compute, then each layer's reads in rounds of `workers`, nothing overlapped
    slow = c_hi + serial_read_s(miss_hi, shape.layers, workers, b, bw_lo)
    fast = max(
        c_lo, miss_lo * b / bw_hi, 1e-9
    )  # reads entirely under the compute, or it under them
    union = chunk_union(q, chunk)
    reads_hi = union if slots < shape.records else 0.0
    reads_lo = max(0.0, union - slots) if slots < shape.records else 0.0
    chunk_seen = compute.get("prefill_reads_per_chunk") or []  # measured by the probe too
    if chunk_seen and slots < shape.records:
        reads_lo, reads_hi = min(reads_lo, min(chunk_seen)), max(reads_hi, max(chunk_seen))
    chunk_slow = chunk * p_hi + serial_read_s(reads_hi, shape.layers, workers, b, bw_lo)
    chunk_fast = max(chunk * p_lo, reads_lo * b / bw_hi, 1e-9)
    fill = min(slots, shape.records) * b
    return {
        "hit_rate": [round(h_lo, 4), round(h_hi, 4)],
        "reads_per_token": [round(miss_lo, 2), round(miss_hi, 2)],
        "MB_per_token": [round(miss_lo * b / 1e6, 2), round(miss_hi * b / 1e6, 2)],
        "decode_tok_s": [round(1 / slow, 3), round(1 / fast, 3)],
        "prefill_chunk_experts": round(union, 1),
        "prefill_tok_s": [round(chunk / chunk_slow, 2), round(chunk / chunk_fast, 2)],
        "cold_fill_s": [round(fill / bw_hi, 4), round(fill / bw_lo, 4)],
        "cold_fill_s_median": round(fill / bw, 4),
    }
