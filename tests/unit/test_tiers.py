"""The two-tier simulator (smoe.bench.tiers) on streams counted by hand."""

import random

import pytest

from smoe.bench.tiers import TierCounts, simulate
from smoe.telemetry.replay import KeyStream, replay_belady

A, B, C = (0, 0), (0, 1), (0, 2)


def test_cycle_exclusive_keeps_three_inclusive_two() -> None:
    # A B C A B C, top 1 slot, second 2 slots, LRU everywhere.
    # Exclusive (3 distinct keys fit): A, B, C read from disk, each demoting the previous
    # one; then A, B, C each come up from the second tier.
    # Inclusive (the second tier holds the top's key too: 2 distinct): every request evicts
    # the key needed next from the second tier, so all 6 are disk reads.
    stream = [[A], [B], [C], [A], [B], [C]]
    assert simulate(stream, 1, 2, "exclusive") == TierCounts(6, 0, 3, 3, demotions=5)
    assert simulate(stream, 1, 2, "inclusive") == TierCounts(6, 0, 0, 6)


def test_return_after_one_other_key() -> None:
    # A B A, top 1, second 1: exclusive demotes A when B comes, A comes back over the bus;
    # inclusive must drop A from the second tier to take B.
    stream = [[A], [B], [A]]
    assert simulate(stream, 1, 1, "exclusive") == TierCounts(3, 0, 1, 2, demotions=2)
    assert simulate(stream, 1, 1, "inclusive") == TierCounts(3, 0, 0, 3)


def test_top_hits_and_pinning() -> None:
    # [A B] [A C] [B]: top 2, second 1, exclusive LRU. Request 2: A is a top hit, C evicts
    # B (A is pinned), B demoted. Request 3: B comes up from the second tier, demoting A
    # (the LRU key of the top: A was used at request 2 before C).
    stream = [[A, B], [A, C], [B]]
    assert simulate(stream, 2, 1, "exclusive") == TierCounts(5, 1, 1, 3, demotions=2)


def test_bounds_hold_on_random_streams() -> None:
    rng = random.Random(0)
    batches = [[(rng.randrange(2), e) for e in rng.sample(range(8), 2)] for _ in range(300)]
    stream = KeyStream.from_requests((b[0][0], [k[1] for k in b]) for b in batches)
    for scheme in ("inclusive", "exclusive", "kept", "landed"):
        for top, second in (("lru", "lru"), ("lfu", "lfu"), ("lfu", "shared")):
            if scheme == "landed" and second != "shared":
                continue
            got = simulate(stream, 3, 5, scheme, top, second)
            assert got.top_hits + got.bus + got.disk == stream.num_requests
            assert got.disk >= replay_belady(stream, 3 + 5).misses
            assert got.bus + got.disk >= replay_belady(stream, 3).misses


def test_inclusive_needs_a_larger_second_tier() -> None:
    with pytest.raises(ValueError):
        simulate([[A]], 2, 1, "inclusive")


def test_kept_copies_spare_the_copies_down_of_a_cycle_the_tier_holds() -> None:
    # A B C A B C A, top 1, second 3 (the whole cycle): exclusive copies each key down on
    # every eviction (6); kept copies each down once (the first time it leaves), after
    # which its copy stays and only copies up move: the same disk reads (3).
    stream = [[A], [B], [C], [A], [B], [C], [A]]
    exclusive = simulate(stream, 1, 3, "exclusive", "lru", "lru")
    kept = simulate(stream, 1, 3, "kept", "lfu", "shared")
    assert (exclusive.disk, exclusive.demotions) == (3, 6)
    assert (kept.disk, kept.bus, kept.demotions) == (3, 4, 3)


def test_landed_reads_enter_both_tiers_and_copy_nothing_down() -> None:
    stream = [[A], [B], [A]]
    got = simulate(stream, 1, 2, "landed", "lfu", "shared")
    assert got == TierCounts(3, 0, 1, 2, demotions=0)
