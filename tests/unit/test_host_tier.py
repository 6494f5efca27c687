"""The host tier (smoe.io.host_tier) and the staged ring's ordered queue under it: what is
copied down and up, in which order, and which images are given up. The tier's logic runs
over a fake bus (a ring that records the copies and runs them when the test says); the
ring's order over a real StagedRing on the CPU. No sleeps: orderings are forced."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from smoe.errors import SmoeError
from smoe.io import StagedRing
from smoe.io.host_tier import HostTier, TieredReader, image_layout
from smoe.plan.host_tier import plan_host_tier
from smoe.vault.layout import RecordLayout

LAYOUT = RecordLayout.build(
    [
        ("w", "uint32", (64, 32)),
        ("scales", "bfloat16", (64, 4)),
    ]
)


def land(ring: StagedRing, slot: int, fill: int) -> None:
    with ring.landing(slot) as memory:
        np.frombuffer(memory, np.uint8)[:] = fill


def raw(a: mx.array) -> bytes:
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes()


def slot_bytes(ring: StagedRing, slot: int) -> bytes:
    bank, local = ring.locate(slot)
    arrays = ring.banks()[bank]
    return b"".join(raw(arrays[c.name][local]) for c in LAYOUT.components)


def image_bytes(tier: HostTier, record: int) -> bytes:
    image = tier._images[tier._where[record].index]  # noqa: SLF001 - what the tier holds
    return b"".join(
        raw(image.component(c, mx.bfloat16 if c.dtype == "bfloat16" else mx.uint32))
        for c in LAYOUT.components
    )


# ---------------------------------------------------------------------------- the ring
def test_a_demotion_copies_what_the_slot_held_when_it_was_queued():
    """Queued in order: a landing into slot 0, its demotion, a landing of another record
    into slot 0, all before one commit: the image gets the first record, the slot the
    second (the ring splits the queue where a demotion would read a slot it lands in)."""
    ring = StagedRing(LAYOUT, 2, mx.bfloat16, landings=2)
    tier = HostTier(ring, 2)
    land(ring, 0, 7)
    tier.demote(record=5, slot=0)
    land(ring, 0, 9)
    assert ring.commit() == 2 and ring.demotions == 1
    tier.check_invariants()
    assert set(image_bytes(tier, 5)) == {7}
    assert set(slot_bytes(ring, 0)) == {9}


def test_an_image_being_filled_is_copied_up_after_it_is_filled():
    """A record demoted and asked for again before the commit: its image is handed up
    while its demotion is still queued; the commit fills it first, then copies it up."""
    ring = StagedRing(LAYOUT, 3, mx.bfloat16, landings=2)
    tier = HostTier(ring, 2)
    land(ring, 0, 3)
    ring.commit()
    tier.demote(record=1, slot=0)
    land(ring, 0, 4)  # another record takes slot 0
    assert tier.take(record=1, slot=2)  # the demoted record, wanted again at once
    ring.commit()
    assert set(slot_bytes(ring, 2)) == {3} and set(slot_bytes(ring, 0)) == {4}
    assert tier._where[1].pins == 0  # noqa: SLF001 - released once copied up
    tier.check_invariants()


def test_closing_the_ring_fails_queued_demotions_and_frees_their_images():
    ring = StagedRing(LAYOUT, 2, mx.bfloat16, landings=1)
    tier = HostTier(ring, 1)
    land(ring, 0, 1)
    tier.demote(record=3, slot=0)
    ring.close()
    assert not tier.holds(3)
    tier.check_invariants()
    tier.demote(record=4, slot=0)  # after close: refused at once, nothing kept
    assert not tier.holds(4)


def test_a_float_record_goes_down_and_up_in_the_slots_dtype_bit_for_bit():
    """Float32 slots (bfloat16 records widened as they land) come back from an image with
    the same bits: an image holds the slot's form, nothing converts on the way."""
    ring = StagedRing(LAYOUT, 2, mx.float32, landings=1)
    tier = HostTier(ring, 1)
    assert tier.image_bytes == image_layout(LAYOUT, mx.float32)[1]
    land(ring, 0, 0x3F)
    ring.commit()
    before = slot_bytes(ring, 0)
    tier.demote(record=0, slot=0)
    land(ring, 0, 0x11)
    ring.commit()
    assert tier.take(record=0, slot=1)
    ring.commit()
    assert slot_bytes(ring, 1) == before


# ---------------------------------------------------------------------------- a fake bus
class FakeBus:
    """Stands in for the staged ring: records each copy; ``run()`` performs the queued
    demotions (done(True)) and copies up (release()) in order."""

    layout = LAYOUT
    dtype = mx.bfloat16

    def __init__(self) -> None:
        self.queue: list[tuple[str, int, object]] = []

    def hand_over_image(self, slot, image, release) -> None:
        self.queue.append(("up", slot, release))

    def queue_demotion(self, slot, image, done) -> None:
        self.queue.append(("down", slot, done))

    def run(self, ok: bool = True) -> list[tuple[str, int]]:
        ran, self.queue = self.queue, []
        for kind, _, call in ran:
            call(ok) if kind == "down" else call()
        return [(kind, slot) for kind, slot, _ in ran]


def tier_over_bus(
    capacity: int, weights: dict[int, float] | None = None
) -> tuple[HostTier, FakeBus]:
    bus = FakeBus()
    weight = (lambda r: weights[r]) if weights is not None else None
    return HostTier(bus, capacity, weight=weight), bus  # type: ignore[arg-type]


def test_a_kept_copy_costs_nothing_to_demote_again():
    tier, bus = tier_over_bus(2)
    tier.demote(10, slot=0)
    assert bus.run() == [("down", 0)]
    assert tier.take(10, slot=1) and bus.run() == [("up", 1)]
    tier.demote(10, slot=1)  # leaves the ring again: its copy is still here
    assert bus.run() == [] and (tier.demoted, tier.kept, tier.hits) == (1, 1, 1)
    tier.check_invariants()


def test_a_full_tier_gives_up_a_copy_of_a_ring_record_first_then_the_least_weight():
    weights = {1: 5.0, 2: 1.0, 3: 9.0, 4: 0.0, 5: 2.0}
    tier, bus = tier_over_bus(3, weights)
    for record in (1, 2, 3):
        tier.demote(record, slot=record)
    bus.run()
    assert tier.take(3, slot=0)  # 3 is in the ring again: its image is free room
    bus.run()
    tier.demote(4, slot=1)
    bus.run()
    assert not tier.holds(3) and tier.holds(1) and tier.holds(2) and tier.holds(4)
    tier.demote(5, slot=2)  # no copy of a ring record left: the least weight (4) goes
    bus.run()
    assert not tier.holds(4) and tier.holds(5) and tier.dropped == 2
    tier.check_invariants()


def test_pinned_and_unfilled_images_are_never_given_up():
    tier, bus = tier_over_bus(2, {1: 0.0, 2: 0.0, 3: 9.0})
    tier.demote(1, slot=0)  # queued, not yet filled
    tier.demote(2, slot=1)
    tier.demote(3, slot=2)  # every image unfilled: not kept
    assert not tier.holds(3) and tier.demoted == 2
    bus.run()
    assert tier.take(1, slot=3) and tier.take(2, slot=4)  # both pinned until copied up
    tier.demote(3, slot=2)
    assert not tier.holds(3)
    bus.run()  # copied up: released, and they are now copies of ring records
    tier.demote(3, slot=2)
    assert tier.holds(3)
    tier.check_invariants()


def test_without_weights_the_oldest_demoted_goes_first():
    tier, bus = tier_over_bus(2)
    for record in (1, 2, 3):
        tier.demote(record, slot=0)
        bus.run()
    assert not tier.holds(1) and tier.holds(2) and tier.holds(3)


@pytest.mark.asyncio
async def test_the_tiered_reader_copies_up_what_the_tier_keeps_and_reads_the_rest():
    tier, bus = tier_over_bus(1)
    tier.demote(7, slot=0)
    bus.run()
    reads = []

    class Disk:
        async def read(self, record, slot, priority=0):
            reads.append((record, slot, priority))
            return 4096

    backend = TieredReader(tier, Disk())
    assert await backend.read(7, 3) == 0  # no bytes from the disk
    assert await backend.read(8, 2, 1) == 4096
    assert reads == [(8, 2, 1)] and bus.run() == [("up", 3)]


# ---------------------------------------------------------------------------- the plan
def test_the_plan_keeps_none_by_default_off_a_discrete_gpu_and_half_the_memory_on_one():
    size = image_layout(LAYOUT, mx.bfloat16)[1]
    kw = dict(ring_kind="staged", ring_slots=10, dtype=mx.bfloat16, distributed=False)
    assert plan_host_tier(LAYOUT, 100, None, discrete=False, **kw).images == 0
    half = plan_host_tier(LAYOUT, 100, None, discrete=True, available=20 * size, **kw)
    assert half.images == 10 and half.nbytes == 10 * size
    assert plan_host_tier(LAYOUT, 100, None, discrete=True, available=10**12, **kw).images == 100
    assert not plan_host_tier(LAYOUT, 100, None, discrete=True, **(kw | {"ring_slots": 100})).images
    assert plan_host_tier(LAYOUT, 100, 0, discrete=True, **kw).images == 0
    assert plan_host_tier(LAYOUT, 100, 5 * size, discrete=False, **kw).images == 5


def test_the_plan_refuses_what_cannot_work_naming_the_fix():
    kw = dict(ring_slots=10, dtype=mx.bfloat16, discrete=False, distributed=False)
    with pytest.raises(SmoeError, match="--ring staged"):
        plan_host_tier(LAYOUT, 100, "1GB", ring_kind="unified", **kw)
    with pytest.raises(SmoeError, match="use --host-memory .* or more"):
        plan_host_tier(LAYOUT, 100, 100, ring_kind="staged", **kw)
