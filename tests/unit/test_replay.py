"""Eviction policies, the cache replay, Belady's optimum and the policy bench."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from smoe.bench.policy import bench_policy, format_table
from smoe.errors import SmoeError
from smoe.sched.policy import (
    ARC,
    LFU,
    LRU,
    POLICIES,
    SLRU,
    LRUPerLayer,
    PinnedHot,
    make_policy,
)
from smoe.sched.types import RingTooSmall
from smoe.telemetry.replay import KeyStream, replay, replay_belady, replay_scheduler


def single(seq: list[int], layer: int = 0) -> list[tuple[int, list[int]]]:
    """One key per request."""
    return [(layer, [x]) for x in seq]


def touch(policy: object, *keys: tuple[int, int]) -> None:
    """Demand each key as the scheduler does on a miss (insert, then the access)."""
    for key in keys:
        policy.on_insert(key)  # type: ignore[attr-defined]
        policy.on_access(key)  # type: ignore[attr-defined]


def random_stream(seed: int, n: int = 400, layers: int = 3, experts: int = 12):
    rng = random.Random(seed)
    return [
        (rng.randrange(layers), rng.sample(range(experts), rng.randint(1, 4))) for _ in range(n)
    ]


# ----------------------------------------------------------------- policies


def test_registry_and_make_policy() -> None:
    assert {"lru", "lru-layer", "lfu", "slru", "arc", "hot"} <= set(POLICIES)
    assert isinstance(make_policy("lru"), LRU)
    assert make_policy("lfu", half_life=10.0).half_life == 10.0  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("nope")


def test_lru_evicts_least_recent() -> None:
    # ring 2: 3 evicts 2 (1 was used more recently), 2 evicts 1, 1 evicts 3.
    got = replay(single([1, 2, 1, 3, 2, 1]), 2, "lru")
    assert (got.hits, got.misses) == (1, 5)


def test_lfu_keeps_the_frequent_key() -> None:
    lfu, lru = LFU(half_life=1000.0), LRU()
    for p in (lfu, lru):
        touch(p, (0, 1))
        for _ in range(3):
            p.on_access((0, 1))
        touch(p, (0, 2))
    assert lfu.victim({(0, 1), (0, 2)}) == (0, 2)  # used once
    assert lru.victim({(0, 1), (0, 2)}) == (0, 1)  # used longest ago


def test_lfu_ageing_forgets_old_counts() -> None:
    # 1 is used 6 times early, then 28 other keys once each, then 99 once.
    kept = {}
    for half_life in (1000.0, 2.0):
        lfu = LFU(half_life=half_life)
        touch(lfu, (0, 1))
        for _ in range(5):
            lfu.on_access((0, 1))
        for e in range(2, 30):
            touch(lfu, (0, e))
        touch(lfu, (0, 99))
        kept[half_life] = lfu.victim({(0, 1), (0, 99)})
    assert kept == {1000.0: (0, 99), 2.0: (0, 1)}  # slow ageing: frequency; fast: recency


def test_lfu_learns_half_life_at_first_eviction() -> None:
    lfu = LFU(half_life_slots=3.0)
    touch(lfu, (0, 1), (0, 2))
    lfu.on_access((0, 1))
    assert lfu.half_life is None
    assert lfu.victim({(0, 1), (0, 2)}) == (0, 2)
    assert lfu.half_life == 6.0  # 3 x the 2 resident keys


def test_arc_resists_a_scan() -> None:
    # a and b are used twice (T2); a scan of one-time keys must not flush them.
    stream = single([1, 2, 1, 2, 10, 11, 12, 13, 14, 15, 1, 2])
    arc, lru = replay(stream, 4, "arc"), replay(stream, 4, "lru")
    assert arc.hits == lru.hits + 2 == 4


def test_arc_ghost_hit_grows_t1_target() -> None:
    arc = ARC(capacity=3)
    touch(arc, (0, 1))
    arc.on_access((0, 1))  # second use: T2
    touch(arc, (0, 2), (0, 3))
    v = arc.victim({(0, 1), (0, 2), (0, 3)})
    assert v == (0, 2)  # |T1| = 2 > p = 0: oldest of T1
    arc.on_remove(v)
    touch(arc, (0, 4))
    assert arc.p == 0.0
    v = arc.victim({(0, 1), (0, 3), (0, 4)})
    assert v == (0, 3)
    arc.on_remove(v)
    touch(arc, (0, 2))  # 2 returns from ghost list B1: T1 should have been bigger
    assert arc.p == 1.0


def test_arc_failed_read_leaves_no_ghost() -> None:
    arc = ARC(capacity=2)
    touch(arc, (0, 1))
    arc.on_remove((0, 1))  # not chosen by victim(): a failed read
    touch(arc, (0, 1))
    assert arc.p == 0.0


def test_slru_protects_reused_keys() -> None:
    stream = single([1, 1, 2, 2, 10, 11, 12, 13, 1, 2])
    slru, lru = replay(stream, 4, "slru"), replay(stream, 4, "lru")
    assert slru.hits == lru.hits + 2


def test_pinned_hot_keeps_hot_keys() -> None:
    hot = PinnedHot([(0, 1)])
    touch(hot, (0, 1), (0, 2), (0, 3))
    assert hot.victim({(0, 1), (0, 2), (0, 3)}) == (0, 2)  # 1 is oldest but hot
    assert hot.victim({(0, 1)}) == (0, 1)  # only hot keys are candidates
    counts = {(0, 1): 5, (0, 2): 9, (0, 3): 1}
    assert PinnedHot.from_counts(counts, 2).hot == {(0, 1), (0, 2)}


def test_lru_per_layer_evicts_from_the_fullest_layer() -> None:
    pol = LRUPerLayer()
    touch(pol, (1, 0), (0, 1), (0, 2), (0, 3))
    assert pol.victim({(1, 0), (0, 1), (0, 2), (0, 3)}) == (0, 1)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_victim_is_always_a_candidate(name: str) -> None:
    """Pinned (non-candidate) keys are never chosen, whatever the policy's preference."""
    rng = random.Random(7)
    pol = make_policy(name)
    resident: list[tuple[int, int]] = []
    for step in range(3000):
        key = (rng.randrange(3), rng.randrange(20))
        if key in resident:
            pol.on_access(key)
        else:
            if len(resident) >= 16:
                allowed = set(rng.sample(resident, rng.randint(1, 4)))
                out = pol.victim(allowed if step % 2 else list(allowed))
                assert out in allowed
                resident.remove(out)
                pol.on_remove(out)
            resident.append(key)
            touch(pol, key)


# ----------------------------------------------------------------- replay and Belady


def test_belady_textbook_example() -> None:
    # Silberschatz et al.: this reference string with 3 frames has 9 faults under OPT,
    # 12 under LRU.
    refs = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]
    assert replay_belady(single(refs), 3).misses == 9
    assert replay(single(refs), 3, "lru").misses == 12


def test_belady_respects_the_current_request() -> None:
    # Ring 3. Request {1,2}, then {3}: evict 2 (used last), not 1 (next needed at once).
    # Then {1, 4}: 1 hits; 4 must not evict 1 (pinned) even though 1 is never used again.
    stream = [(0, [1, 2]), (0, [3]), (0, [1, 4]), (0, [3]), (0, [2])]
    got = replay_belady(stream, 3)
    assert (got.hits, got.misses) == (2, 5)


def test_ring_too_small_is_refused() -> None:
    with pytest.raises(RingTooSmall):
        replay([(0, [1, 2, 3])], 2, "lru")
    with pytest.raises(RingTooSmall):
        replay_belady([(0, [1, 2, 3])], 2)


@pytest.mark.parametrize("seed", range(4))
def test_belady_beats_every_policy(seed: int) -> None:
    stream = KeyStream.from_requests(random_stream(seed))
    for slots in (4, 9, 20):
        best = replay_belady(stream, slots)
        for name in POLICIES:
            assert best.misses <= replay(stream, slots, name).misses, (name, slots)
        # less foresight can only cost more; foresight beyond the stream changes nothing
        assert replay_belady(stream, slots, horizon=10).misses >= best.misses
        assert replay_belady(stream, slots, horizon=10**6).misses == best.misses


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_replay_matches_the_real_scheduler(name: str) -> None:
    stream = KeyStream.from_requests(random_stream(11, n=250))
    for slots in (4, 10, 24):
        sim = replay(stream, slots, name, record_bytes=3)
        real = replay_scheduler(stream, slots, name, record_bytes=3)
        assert (sim.hits, sim.misses) == (real.hits, real.misses), (name, slots)
        assert sim.bytes == 3 * sim.misses


def test_result_counts_and_dict() -> None:
    got = replay([(0, [1, 2]), (1, [1]), (0, [2, 2])], 8, "lru", record_bytes=10)
    assert (got.requests, got.hits, got.misses, got.bytes) == (4, 1, 3, 30)
    assert got.to_dict()["hit_rate"] == 0.25


def test_key_stream_next_use() -> None:
    s = KeyStream.from_requests([(0, [1, 2]), (0, [3]), (0, [2, 1])])
    assert s.next_use.tolist() == [2, 2, 3, 3, 3]
    assert (s.working_set, s.widest, s.num_requests) == (3, 2, 5)


# ----------------------------------------------------------------- bench and plots


def test_bench_policy_report() -> None:
    from smoe.telemetry.traces import preset_trace

    arch = preset_trace("qwen3-30b-like", 120, layers=4, seed=3)
    report = bench_policy(arch, (0.25, 0.5))
    json.dumps(report)
    assert report["trace"]["record_bytes"] == 2_654_208
    for ring in report["rings"]:
        for name, res in ring["policies"].items():
            assert res["vs_belady"] >= 1.0, name
            assert res["bytes"] == res["misses"] * 2_654_208
    assert "x Belady" in format_table(report)


def test_plots(tmp_path) -> None:
    from smoe.bench.plots import plot_hit_rates, plot_time_breakdown

    report = bench_policy(random_stream(1), (0.5, 0.9), ("lru", "arc"))
    assert plot_hit_rates(report, tmp_path / "h.png").stat().st_size > 0
    rows = [
        {"budget": "8 GiB", "compute_s": 0.05, "io_wait_s": 0.2, "other_s": 0.01},
        {"budget": "16 GiB", "compute_s": 0.05, "io_wait_s": 0.05, "other_s": 0.01},
    ]
    assert plot_time_breakdown(rows, tmp_path / "t.png").stat().st_size > 0


def test_plots_name_the_extra_when_matplotlib_is_missing(monkeypatch, tmp_path) -> None:
    import builtins

    from smoe.bench import plots

    real_import = builtins.__import__

    def no_mpl(name: str, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    with pytest.raises(SmoeError, match=r'pip install "smoe\[plot\]"'):
        plots.plot_time_breakdown([{"budget": 1}], tmp_path / "x.png")


def test_unused_policy_classes_are_constructible() -> None:
    for cls in (LRU, LRUPerLayer, LFU, SLRU, ARC, PinnedHot):
        assert cls().name in POLICIES


# ----------------------------------------------------------------- hints and prefetch


def _foresight_stream(seed: int, n: int = 250) -> KeyStream:
    """random_stream's requests with random hints (same layer) and prefetch lists."""
    rng = random.Random(seed)
    reqs = random_stream(seed, n=n)
    hints = [[(layer, e) for e in rng.sample(range(12), rng.randint(0, 5))] for layer, _ in reqs]
    pre = [[(rng.randrange(3), e) for e in rng.sample(range(12), rng.randint(0, 4))] for _ in reqs]
    return KeyStream.from_requests(reqs).with_foresight(hints, pre)


HINTABLE = sorted(n for n in POLICIES if hasattr(make_policy(n), "on_hint"))


def test_hintable_policies() -> None:
    assert HINTABLE == ["lfu", "lru", "lru-layer"]


@pytest.mark.parametrize(
    ("name", "hints", "prefetch"),
    [(n, True, False) for n in HINTABLE]
    + [(n, False, True) for n in sorted(POLICIES)]
    + [(n, True, True) for n in HINTABLE],
)
def test_replay_with_foresight_matches_the_real_scheduler(
    name: str, hints: bool, prefetch: bool
) -> None:
    """Hints (ExpertScheduler.hint) and prefetches (ExpertScheduler.prefetch, reads done
    before the next request): the simulator and the scheduler agree on every count."""
    stream = _foresight_stream(5)
    for slots in (4, 10, 24):
        sim = replay(stream, slots, name, record_bytes=3, hints=hints, prefetch=prefetch)
        real = replay_scheduler(stream, slots, name, record_bytes=3, hints=hints, prefetch=prefetch)
        got = (sim.hits, sim.misses, sim.spec_reads, sim.spec_used)
        assert got == (real.hits, real.misses, real.spec_reads, real.spec_used), (name, slots)
        assert sim.policy == real.policy
        assert sim.bytes == 3 * sim.reads == 3 * (sim.misses + sim.spec_reads)
        if prefetch:
            assert sim.spec_reads > 0


def test_hints_change_the_victim_in_replay() -> None:
    # ring 3: 1, 2, 3, then 4 evicts 1 -- unless 1 was hinted after the request for 3.
    stream = KeyStream([[(0, 1)], [(0, 2)], [(0, 3)], [(0, 4)], [(0, 1)]])
    hinted = stream.with_foresight([[], [], [(0, 1)], [], []])
    assert replay(stream, 3, "lru").misses == 5
    assert replay(hinted, 3, "lru", hints=True).misses == 4
    with pytest.raises(ValueError, match="hints need"):
        replay(stream, 3, "lru", hints=True)
    with pytest.raises(ValueError, match="hints need"):
        replay(hinted, 3, "arc", hints=True)


def test_prefetch_semantics() -> None:
    # ring 2. After {1}: prefetch 2 and 3 -- 2 takes the free slot, 3 evicts 1 (2 is
    # loading, not a candidate). {2} hits a bet; {1} misses; 3 was never used.
    stream = KeyStream([[(0, 1)], [(0, 2)], [(0, 1)]], prefetch=[[(0, 2), (0, 3)], [], []])
    got = replay(stream, 2, "lru", prefetch=True, record_bytes=10)
    assert (got.hits, got.misses, got.spec_reads, got.spec_used) == (1, 2, 2, 1)
    assert (got.reads, got.bytes, got.policy) == (4, 40, "lru+prefetch")
    # a ring of one: the bet cannot evict anything but what it loads itself
    one = KeyStream([[(0, 1)], [(0, 2)]], prefetch=[[(0, 2), (0, 3)], []])
    got = replay(one, 1, "lru", prefetch=True)
    assert (got.hits, got.misses, got.spec_reads) == (1, 1, 1)
    assert replay_scheduler(one, 1, "lru", prefetch=True).spec_reads == 1


def _archive(ahead: bool = True):
    """2 layers, 8 experts top-2, depth 6: a 2-token prefill chunk, then 3 decode steps."""
    from smoe.telemetry.archive import DECODE, NO_EXPERT, PREFILL, RoutingArchive

    rng = np.random.default_rng(0)
    ranks = np.stack([np.stack([rng.permutation(8)[:6] for _ in range(2)]) for _ in range(5)])
    look = np.full_like(ranks, NO_EXPERT)
    look[:, 1] = np.roll(ranks[:, 1], 1, axis=-1)  # layer 1 as "predicted" from layer 0
    return RoutingArchive(
        8,
        2,
        [3, 4],
        ranks.astype(np.uint16),
        np.array([0, 0, 1, 2, 3], np.int32),
        np.array([PREFILL, PREFILL, DECODE, DECODE, DECODE], np.uint8),
        {"record_bytes": 5},
        ahead=look.astype(np.uint16) if ahead else None,
    )


def test_foresight_lists_from_an_archive() -> None:
    from smoe.bench.policy import foresight_from_archive

    arch = _archive()
    stream, spec = foresight_from_archive(arch, hint_depth=5, lookahead=True, echo=2)
    assert len(stream.batches) == 8 and stream.hints is not None
    r, a = arch.ranks.astype(int), arch.ahead.astype(int)
    # prefill chunk (tokens 0-1): no prefetch; hints: unused experts of ranks 2..4
    assert spec["echo"][:2] == [[], []] and spec["lookahead"][:2] == [[], []]
    used = set(r[0:2, 0, :2].ravel())
    assert stream.hints[0] == [(0, e) for e in sorted(set(r[0:2, 0, 2:5].ravel()) - used)]
    # decode step of token 2: echo = its ranks 2..3 at each layer, in rank order;
    # lookahead after layer 0 = the recorded top-2 for layer 1, ascending; none after layer 1
    assert spec["echo"][2] == [(0, r[2, 0, 2]), (0, r[2, 0, 3])]
    assert spec["echo"][3] == [(1, r[2, 1, 2]), (1, r[2, 1, 3])]
    assert spec["lookahead"][2] == [(1, e) for e in sorted(a[2, 1, :2])]
    assert spec["lookahead"][3] == []
    # teacher-forced text, one token per batch: prefill steps count as decode on request
    import dataclasses

    single = dataclasses.replace(arch, batch=np.arange(5, dtype=np.int32))
    _, spec = foresight_from_archive(single, lookahead=True, echo=2)
    assert spec["lookahead"][0] == [] and spec["echo"][0] == []
    _, spec = foresight_from_archive(single, lookahead=True, echo=2, prefill_as_decode=True)
    assert spec["lookahead"][0] == [(1, e) for e in sorted(a[0, 1, :2])]
    assert spec["echo"][0] == [(0, r[0, 0, 2]), (0, r[0, 0, 3])]
    # an archive without the lookahead record (older archives): no lookahead lists
    _, spec = foresight_from_archive(_archive(ahead=False), lookahead=True, echo=0)
    assert spec == {}


def test_bench_policy_foresight_lines() -> None:
    arch = _archive()
    report = bench_policy(
        arch, (0.5, 1.0), ("lru", "lfu", "arc"), hint_depth=6, lookahead=True, echo=2
    )
    json.dumps(report)
    assert report["trace"]["lookahead"] == "recorded" and report["trace"]["echo"] == 2
    for ring in report["rings"]:
        assert {"lru+hint", "lfu+hint"} <= set(ring["policies"])
        assert set(ring["foresight"]) == {
            f"{p}+{kind}"
            for p in ("lru", "lfu")
            for kind in ("lookahead", "echo", "hint+lookahead")
        }
        for name, line in ring["foresight"].items():
            assert line["policy"] == name
            assert line["reads"] == line["misses"] + line["spec_reads"]
            assert line["bytes"] == 5 * line["reads"]
            best = ring["belady"]["misses"]
            assert line["reads_vs_belady"] == round(line["reads"] / best, 4)
            plain = ring["policies"][name.split("+")[0]]["misses"]
            assert line["vs_policy"] == round(line["misses"] / plain, 4)
    table = format_table(report)
    assert "prefetch line" in table and "lru+hint+lookahead" in table
    old = bench_policy(_archive(ahead=False), (0.5,), ("lru",), lookahead=True)
    assert "not in this archive" in old["trace"]["lookahead"]
    assert "foresight" not in old["rings"][0]


def test_bench_policy_cli_foresight(tmp_path, capsys) -> None:
    from smoe.bench.policy import main

    path = _archive().save(tmp_path / "a.npz")
    assert (
        main([str(path), "--foresight", "--rings", "0.5", "--json", str(tmp_path / "r.json")]) == 0
    )
    report = json.loads((tmp_path / "r.json").read_text())
    trace = report["trace"]
    assert (trace["hint_depth"], trace["echo"], trace["lookahead"]) == (6, 2, "recorded")
    assert "lfu+hint+lookahead" in report["rings"][0]["foresight"]
    assert "prefetch line" in capsys.readouterr().err  # the table: stdout is JSON lines
