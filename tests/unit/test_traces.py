"""Synthetic routing traces and locality statistics."""

from __future__ import annotations

import numpy as np
import pytest

from smoe.bench.policy import bench_locality, stream_from_archive
from smoe.telemetry.archive import DECODE, PREFILL, RoutingArchive
from smoe.telemetry.locality import headline, locality
from smoe.telemetry.traces import PRESETS, TARGETS, TraceParams, generate, preset_trace


def hand_made(phase: list[int] | None = None) -> RoutingArchive:
    """1 layer, 6 experts, top-2, depth 4; rows are gate rankings."""
    ranks = np.array([[0, 1, 2, 3], [1, 2, 0, 4], [3, 4, 5, 0], [0, 1, 2, 3]], np.uint16)
    n = len(ranks)
    return RoutingArchive(
        6,
        2,
        [5],
        ranks[:, None, :],
        np.arange(n, dtype=np.int32),
        np.array(phase or [DECODE] * n, np.uint8),
    )


def test_locality_known_answers() -> None:
    rep = locality(hand_made(), windows=(1, 2))
    # pairs: {0,1}->{1,2}: 1/2; {1,2}->{3,4}: 0; {3,4}->{0,1}: 0
    assert rep["adjacent_overlap"]["overall"] == pytest.approx(1 / 6)
    # within 2: token 2 ({3,4} vs {0,1,2}): 0; token 3 ({0,1} vs {1,2,3,4}): 1/2
    assert rep["reuse_within"]["2"]["overall"] == pytest.approx(0.25)
    # top-4 of t covers next top-2: {0,1,2,3}>{1,2}: 1; {1,2,0,4}>{3,4}: 1/2; {3,4,5,0}>{0,1}: 1/2
    assert rep["coverage"]["4"]["overall"] == pytest.approx(2 / 3)
    assert rep["coverage"]["2"]["overall"] == pytest.approx(1 / 6)
    # picks: expert 1 three times of 8; 6 experts -> the top 25% is one expert
    assert rep["popularity"]["top25pct_share"]["overall"] == pytest.approx(3 / 8)
    assert (rep["tokens"], rep["pairs"], rep["layers"]) == (4, 3, 1)
    assert headline(rep)["cover_2k"] == pytest.approx(2 / 3)


def test_locality_does_not_chain_across_a_prefill() -> None:
    rep = locality(hand_made([DECODE, DECODE, PREFILL, DECODE]))
    assert rep["pairs"] == 1
    assert rep["adjacent_overlap"]["overall"] == pytest.approx(0.5)
    everything = locality(hand_made([DECODE, DECODE, PREFILL, DECODE]), phase=None)
    assert everything["pairs"] == 3


def test_generator_shapes_and_determinism() -> None:
    p = TraceParams(num_experts=32, top_k=4, layers=3, depth=12, drift=1.0, deep_noise=0.5)
    a, b = generate(p, 50, seed=4), generate(p, 50, seed=4)
    assert a.ranks.shape == (50, 3, 12) and a.ranks.dtype == np.uint16
    assert np.array_equal(a.ranks, b.ranks)
    assert not np.array_equal(a.ranks, generate(p, 50, seed=5).ranks)
    # every ranking lists distinct experts
    assert all(len(set(row)) == 12 for row in a.ranks.reshape(-1, 12).tolist())
    assert (a.phase == DECODE).all() and np.array_equal(a.batch, np.arange(50))


def test_keep_sets_the_overlap_without_other_locality() -> None:
    # Uniform popularity: overlap = keep + chance re-draws of dropped experts,
    # E[(k - m)^2 / (E - m)] / k with m ~ Bin(k, keep): about 0.018 here.
    p = TraceParams(num_experts=128, top_k=8, layers=8, zipf=0.0, keep=0.5)
    got = headline(locality(generate(p, 3000, seed=0)))["overlap"]
    assert got == pytest.approx(0.518, abs=0.01)


def test_promote_raises_deep_coverage_only() -> None:
    base = TraceParams(num_experts=128, top_k=8, layers=8, zipf=0.5, keep=0.3)
    lo = headline(locality(generate(base, 2000, seed=0)))
    hi = headline(locality(generate(TraceParams(**{**base.__dict__, "promote": 0.4}), 2000)))
    assert hi["cover_2k"] - hi["overlap"] > lo["cover_2k"] - lo["overlap"] + 0.2


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_hit_their_targets(name: str) -> None:
    # a different seed and size than the calibration's
    got = headline(locality(preset_trace(name, 3000, layers=16, seed=7)))
    for stat, want in TARGETS[name].items():
        assert got[stat] == pytest.approx(want, abs=0.02), stat


def test_archive_round_trip_and_bench_locality(tmp_path) -> None:
    arch = preset_trace("qwen3-235b-like", 40, layers=2, seed=1)
    again = RoutingArchive.load(arch.save(tmp_path / "t.npz"))
    assert np.array_equal(again.ranks, arch.ranks) and again.top_k == 8
    assert again.meta["record_bytes"] == 10_616_832
    rep = bench_locality(again)
    assert rep["source"] == "qwen3-235b-like" and 0 < rep["headline"]["overlap"] < 1


def test_stream_from_archive_matches_requests_and_hints() -> None:
    arch = generate(TraceParams(num_experts=16, top_k=2, layers=2, depth=6), 30, seed=2)
    arch.batch = (np.arange(30) // 3).astype(np.int32)  # 3 tokens per batch
    stream = stream_from_archive(arch, None, hint_depth=6)
    want = [[(pos, e) for e in experts] for pos, experts in arch.requests()]
    assert stream.batches == want
    assert stream.hints is not None
    for used, hint in zip(stream.batches, stream.hints, strict=True):
        assert hint and not set(hint) & set(used)
