"""The expert scheduler, driven by a backend whose reads complete when the test says."""

from __future__ import annotations

import asyncio
import random

import pytest

from smoe.errors import SmoeError
from smoe.sched.scheduler import ExpertScheduler
from smoe.sched.types import Priority, ReadError, RingTooSmall, SlotState
from tests.fakes import ControlledBackend, QueuedBackend, record_of, settle

pytestmark = pytest.mark.asyncio


def make(
    slots: int = 8, workers: int = 2, backend: ControlledBackend | None = None, runway: int = 0
):
    backend = backend or ControlledBackend()
    sched = ExpertScheduler(
        slots, backend, record_of=record_of, record_bytes=100, workers=workers, runway=runway
    )
    return sched, backend


def spawn(coro):
    return asyncio.get_running_loop().create_task(coro)


async def test_miss_then_hit():
    sched, be = make()
    task = spawn(sched.acquire(0, [1, 2]))
    await settle()
    assert be.started_records() == [1, 2] and not task.done()
    be.complete(1)
    await settle()
    assert not task.done()  # all slots must be ready
    be.complete(2)
    slots = await task
    assert [be.memory[s] for s in slots] == [1, 2]
    sched.release(slots)
    again = await sched.acquire(0, [2, 1])
    assert again == slots[::-1]
    assert (sched.stats.hits, sched.stats.misses, sched.stats.io_errors) == (2, 2, 0)
    assert sched.stats.by_priority[Priority.DEMAND].reads == 2
    assert sched.stats.by_priority[Priority.DEMAND].bytes == 200
    sched.release(again)
    sched.check_invariants()


async def test_duplicates_in_one_request_share_a_slot():
    sched, be = make()
    be.auto = True
    slots = await sched.acquire(0, [3, 3, 4])
    assert len(slots) == 2 and be.started_records() == [3, 4]


async def test_demand_overtakes_queued_speculation():
    sched, be = make(workers=1)
    assert sched.prefetch(0, [1, 2, 3]) == 3
    await settle()
    assert be.started_records() == [1]  # one worker: the rest wait in the queue
    task = spawn(sched.acquire(0, [9]))
    await settle()
    assert sched.queue_depth(Priority.DEMAND) == 1
    be.complete(1)  # the read in flight finishes: the worker takes demand next
    await settle()
    assert be.started_records() == [1, 9]
    be.complete(9)
    await task
    await settle()
    assert be.started_records() == [1, 9, 2]


async def test_a_demand_read_waits_behind_at_most_the_reads_in_flight():
    sched, be = make(workers=2)
    sched.prefetch(0, range(6))
    await settle()
    assert be.started_records() == [0, 1]
    task = spawn(sched.acquire(1, [7]))
    await settle()
    be.complete(0)
    await settle()
    assert be.started_records() == [0, 1, 107]  # not 2, 3, ...
    be.complete(107)
    await task


async def test_a_runway_hands_reads_ahead_and_demand_passes_handed_speculation():
    """With a runway each worker has its next read waiting in the backend, so it never
    waits for the event loop between reads; a demand read is still handed at once, and
    the backend starts it before the speculative reads handed earlier."""
    be = QueuedBackend(workers=1)
    sched, _ = make(workers=1, backend=be, runway=1)
    sched.prefetch(0, [1, 2, 3])
    await settle()
    assert be.handed == [1, 2] and be.started_records() == [1]  # 2 waits in the backend
    assert sched.queue_depth(Priority.SPECULATIVE) == 1  # 3 is still the scheduler's
    task = spawn(sched.acquire(0, [9]))
    await settle()
    assert be.handed == [1, 2, 9] and be.waiting() == [9, 2]  # demand runs first
    sched.check_invariants()
    be.complete(1)
    await settle()
    assert be.started_records() == [1, 9]
    be.complete(9)
    slots = await task
    sched.release(slots)
    await settle()
    assert be.started_records() == [1, 9, 2] and be.handed == [1, 2, 9, 3]
    be.complete(2)
    await settle()
    be.complete(3)
    await settle()
    sched.check_invariants()
    await sched.close()


async def test_without_speculation_a_runway_keeps_demand_in_order():
    be = QueuedBackend(workers=2)
    sched, _ = make(workers=2, backend=be, runway=2)
    tasks = [spawn(sched.acquire(0, [e])) for e in range(6)]
    await settle()
    assert be.handed == [0, 1, 2, 3] and be.started_records() == [0, 1]
    be.complete(1)
    await settle()
    assert be.started_records() == [0, 1, 2] and be.handed == [0, 1, 2, 3, 4]
    for r in (0, 2, 3, 4, 5):
        while r not in be.pending:
            await settle()
        be.complete(r)
    for t in tasks:
        sched.release(await t)
    sched.check_invariants()
    await sched.close()


async def test_two_requests_share_one_read():
    sched, be = make()
    t1, t2 = spawn(sched.acquire(0, [5])), spawn(sched.acquire(0, [5]))
    await settle()
    assert be.started_records() == [5]
    be.complete(5)
    s1, s2 = await t1, await t2
    assert s1 == s2
    assert sched.stats.misses == 1 and sched.stats.hits == 1
    sched.check_invariants()


async def test_queued_speculation_is_promoted():
    sched, be = make(workers=1)
    sched.prefetch(0, [1, 2, 3])
    await settle()
    task = spawn(sched.acquire(0, [3]))  # 3 is queued behind 2
    await settle()
    assert sched.stats.promotions == 1
    be.complete(1)
    await settle()
    assert be.started_records() == [1, 3]  # promoted ahead of bet 2
    be.complete(3)
    assert await task
    assert sched.stats.speculative_used == 1 and sched.stats.misses == 0


async def test_in_flight_speculation_is_awaited_not_read_again():
    sched, be = make(workers=1)
    sched.prefetch(0, [4])
    await settle()
    task = spawn(sched.acquire(0, [4]))
    await settle()
    be.complete(4)
    await task
    assert be.started_records() == [4]
    assert sched.stats.by_priority[Priority.DEMAND].reads == 1  # counted where it ended


async def test_pinned_slots_are_never_evicted_or_overwritten():
    sched, be = make(slots=2)
    be.auto = True
    held = await sched.acquire(0, [1, 2])
    waiter = spawn(sched.acquire(0, [3]))
    await settle()
    assert be.started_records() == [1, 2]  # no slot to put 3 in: it waits for room
    assert sched.prefetch(0, [8]) == 0
    assert [be.memory[s] for s in held] == [1, 2]
    sched.release(held)
    slots = await waiter
    assert be.memory[slots[0]] == 3
    sched.check_invariants()


async def test_a_task_holding_pins_gets_an_error_instead_of_deadlock():
    sched, be = make(slots=3)
    be.auto = True
    await sched.acquire(0, [1, 2])
    with pytest.raises(RingTooSmall, match="release them first"):
        await sched.acquire(1, [1, 2])
    sched.check_invariants()


async def test_request_larger_than_ring():
    sched, _ = make(slots=4)
    with pytest.raises(RingTooSmall, match="only 4 slots") as info:
        await sched.acquire(0, range(5))
    assert info.value.needed == 5


async def test_io_error_reaches_every_awaiter_and_leaks_nothing():
    sched, be = make(slots=4)
    t1, t2 = spawn(sched.acquire(2, [7, 1])), spawn(sched.acquire(2, [7]))
    await settle()
    be.complete(201)
    be.complete(207, OSError(5, "Input/output error"))
    for t in (t1, t2):
        with pytest.raises(ReadError, match="expert 7 of layer 2"):
            await t
    await settle()
    assert sched.stats.io_errors == 1
    assert sched.stats.misses == 2 and sched.stats.hits == 1  # errors are not misses
    assert sched.state_of((2, 7)) is SlotState.EMPTY
    assert sched.state_of((2, 1)) is SlotState.READY  # cached, unpinned
    assert all(pins == 0 for _, _, pins in sched.slot_table())
    sched.check_invariants()
    be.auto = True
    assert await sched.acquire(2, [7])  # a later request reads it again
    await sched.close()


async def test_a_failed_wait_releases_nothing_its_holder_releases_once():
    """One owner per pin: wait()/wait_any() raise a failed read's ReadError (a SmoeError)
    and leave the pins to the Reservation's holder, whose release is the only one. (They
    used to release too, so the holder's ``finally`` released every slot a second time.)"""
    sched, be = make(slots=4)
    owner = object()
    res = await sched.reserve(2, [7, 1, 3], owner=owner)
    await settle()
    be.complete(201)
    be.complete(207, OSError(5, "Input/output error"))
    await settle()
    be.complete(203)  # (two workers: its read started after one of those ended)
    await settle()
    with pytest.raises(ReadError, match="expert 7 of layer 2") as e:
        await res.wait_any([0, 2])
    assert isinstance(e.value, SmoeError) and not isinstance(e.value, OSError)
    assert e.value.errno == 5 and e.value.key == (2, 7) and e.value.record == 207
    with pytest.raises(ReadError):
        await res.wait()
    assert sched.holders() == {owner: 3}  # still the holder's
    sched.check_invariants()
    res.release()
    res.release()  # a finally after an early release: nothing more
    assert sched.holders() == {} and all(pins == 0 for _, _, pins in sched.slot_table())
    assert sched.state_of((2, 3)) is SlotState.READY
    with pytest.raises(RuntimeError, match="released more often than pinned"):
        sched.release(res.slots, owner)  # checked also under python -O: nothing changes
    sched.check_invariants()


async def test_wait_raises_as_soon_as_one_read_fails():
    """A layer whose first expert fails does not wait for the others' reads to fail."""
    sched, be = make(slots=4)
    res = await sched.reserve(2, [7, 1])
    await settle()
    waiting = spawn(res.wait())
    be.complete(207, OSError(5, "Input/output error"))
    await settle()
    assert waiting.done(), "wait() waited for the read of expert 1 after 7 failed"
    with pytest.raises(ReadError, match="expert 7 of layer 2"):
        waiting.result()
    res.release()
    be.complete(201)
    await settle()
    assert sched.state_of((2, 1)) is SlotState.READY  # the read in flight stays cached
    sched.check_invariants()


async def test_a_reservation_as_context_manager_releases_when_its_entry_fails():
    sched, be = make(slots=4)
    res = await sched.reserve(0, [1, 2])
    await settle()
    be.complete(1, OSError(5, "Input/output error"))
    be.complete(2)
    with pytest.raises(ReadError):
        async with res:
            pytest.fail("entered after a failed read")
    assert sched.holders() == {} and res.released
    sched.check_invariants()


async def test_cancel_while_read_in_flight_keeps_the_record_cached():
    sched, be = make()
    task = spawn(sched.acquire(0, [1]))
    await settle()
    task.cancel()
    await settle()
    assert task.cancelled()
    assert all(pins == 0 for _, _, pins in sched.slot_table())
    assert sched.state_of((0, 1)) is SlotState.LOADING  # the thread cannot be stopped
    be.complete(1)
    await settle()
    assert sched.state_of((0, 1)) is SlotState.READY
    be.auto = True
    await sched.acquire(0, [1])
    assert be.started_records() == [1] and sched.stats.hits == 1
    sched.check_invariants()


async def test_cancel_drops_a_queued_demand_read():
    sched, be = make(workers=1)
    first = spawn(sched.acquire(0, [1]))
    second = spawn(sched.acquire(0, [2]))
    await settle()
    second.cancel()
    await settle()
    be.complete(1)
    await first
    await settle()
    assert be.started_records() == [1]  # 2 was never read
    assert sched.state_of((0, 2)) is SlotState.EMPTY
    sched.check_invariants()


async def test_cancel_while_waiting_for_room():
    sched, be = make(slots=1)
    be.auto = True
    held = await sched.acquire(0, [1])
    waiter = spawn(sched.acquire(0, [2]))
    await settle()
    assert sched.waiting_for_room() == 1
    waiter.cancel()
    await settle()
    assert sched.waiting_for_room() == 0
    sched.release(held)
    sched.check_invariants()
    assert await sched.acquire(0, [2])


async def test_speculation_never_takes_pinned_slots_or_runs_while_demand_waits():
    sched, be = make(slots=3)
    be.auto = True
    held = await sched.acquire(0, [1, 2])
    assert sched.prefetch(0, [5, 6]) == 1  # only the one free slot
    await settle()
    assert [be.memory[s] for s in held] == [1, 2]
    waiter = spawn(sched.acquire(1, [1, 2]))  # needs 2, only the bet's slot is free
    await settle()
    assert sched.prefetch(0, [7]) == 0  # demand is waiting: no bets
    sched.release(held)
    await waiter
    sched.check_invariants()


async def test_demand_takes_the_slot_of_a_queued_bet():
    sched, be = make(slots=2, workers=1)
    sched.prefetch(0, [1, 2])  # 1 in flight, 2 queued; the ring is full
    await settle()
    task = spawn(sched.acquire(0, [9]))
    await settle()
    assert sched.state_of((0, 2)) is SlotState.EMPTY  # the queued bet gave way
    be.complete(1)
    await settle()
    be.complete(9)
    await task
    assert be.started_records() == [1, 9]
    assert sched.stats.by_priority[Priority.SPECULATIVE].cancelled == 1


async def test_cancel_speculative():
    sched, be = make(workers=1)
    sched.prefetch(0, [1, 2, 3])
    await settle()
    assert sched.cancel_speculative(keep=lambda key: key == (0, 3)) == 1
    assert sched.state_of((0, 2)) is SlotState.EMPTY
    assert sched.state_of((0, 3)) is SlotState.LOADING
    sched.check_invariants()


async def test_lru_evicts_the_least_recently_used():
    sched, be = make(slots=3)
    be.auto = True
    for e in (1, 2, 3):
        sched.release(await sched.acquire(0, [e]))
    sched.release(await sched.acquire(0, [1]))  # 2 is now the oldest
    sched.release(await sched.acquire(0, [4]))
    assert sched.state_of((0, 2)) is SlotState.EMPTY
    assert {sched.state_of((0, e)) for e in (1, 3, 4)} == {SlotState.READY}


@pytest.mark.parametrize("policy", ["lru", "lfu", "lru-layer"])
async def test_a_hinted_resident_expert_survives_the_eviction_that_would_take_it(policy):
    """Ring of 3. 9 goes at the first eviction (LFU fixes its half-life then); 1, 2, 3 are
    used in turn and a miss for 4 evicts 1, the least recently (and as often) used, unless
    the router ranked 1 just below the used experts of the two requests after it (hinted
    after each, as the engine does); then 2 goes instead."""
    victims = {}
    for hinted in (False, True):
        be = ControlledBackend(auto=True)
        sched = ExpertScheduler(3, be, record_of=record_of, record_bytes=100, policy=policy)
        assert sched.takes_hints
        for e in (9, 1, 2, 3):
            sched.release(await sched.acquire(0, [e]))
            if hinted and e in (2, 3):
                assert sched.hint(0, [1, 7]) == 1  # 7 is not in the ring: ignored
        sched.release(await sched.acquire(0, [4]))
        victims[hinted] = [e for e in (1, 2, 3) if sched.state_of((0, e)) is SlotState.EMPTY]
        assert sched.stats.hints == 2 * hinted
        assert (sched.stats.hits, sched.stats.misses) == (0, 5)  # a hint is no access
        sched.check_invariants()
    assert victims == {False: [1], True: [2]}


async def test_a_hint_reads_pins_and_evicts_nothing():
    sched, be = make(slots=4)
    be.auto = True
    sched.release(await sched.acquire(0, [1, 2]))
    held = await sched.acquire(1, [5])
    before = sched.slot_table()
    assert sched.hint(0, [1, 2, 3, 3]) == 2  # 3 is not in the ring
    assert sched.hint(1, [5]) == 1  # pinned by another request: still just a hint
    assert sched.slot_table() == before
    assert be.started_records() == [1, 2, 105] and sched.stats.hits == 0
    sched.release(held)
    sched.check_invariants()


async def test_a_hint_reaches_an_expert_still_loading():
    """A key being read (here a bet) is in the ring: it is hinted like a READY one."""
    sched, be = make(slots=3)
    be.auto = True
    for e in (1, 2):
        sched.release(await sched.acquire(0, [e]))
    sched.prefetch(0, [3])  # not started yet: the loop has not run
    assert sched.state_of((0, 3)) is SlotState.LOADING
    assert sched.hint(0, [1, 3]) == 2
    await settle()
    sched.release(await sched.acquire(0, [4]))  # 2 is the oldest now: 1 and 3 were hinted
    assert sched.state_of((0, 2)) is SlotState.EMPTY
    assert {sched.state_of((0, e)) for e in (1, 3, 4)} == {SlotState.READY}


async def test_hints_are_ignored_by_policies_without_them():
    be = ControlledBackend(auto=True)
    sched = ExpertScheduler(3, be, record_of=record_of, record_bytes=100, policy="arc")
    sched.release(await sched.acquire(0, [1]))
    assert not sched.takes_hints
    assert sched.hint(0, [1]) == 0 and sched.stats.hints == 0


async def test_close_waits_for_reads_in_flight():
    sched, be = make()
    task = spawn(sched.acquire(0, [1]))
    await settle()
    closer = spawn(sched.close())
    await settle()
    assert not closer.done()  # a read is still writing into its slot
    be.complete(1)
    await closer
    await task
    with pytest.raises(RuntimeError, match="closed"):
        await sched.acquire(0, [2])


@pytest.mark.parametrize("runway", [0, 2])
@pytest.mark.parametrize("seed", range(8))
async def test_randomized_stress(seed, runway):
    """Many tasks acquire, hold, and release random experts (and pass random hints) while
    reads complete, fail or stall in random order and some tasks are cancelled. After every step the slot
    table is consistent, and every slot a task holds contains the record it asked for.
    With a runway the backend queues the reads handed beyond its workers."""
    rng = random.Random(seed)
    hint_rng = random.Random(seed + 1000)
    slots = rng.choice([4, 6, 10])
    workers = rng.choice([1, 2, 3])
    backend = QueuedBackend(workers=workers) if runway else ControlledBackend()
    sched, be = make(slots=slots, workers=workers, backend=backend, runway=runway)
    held: dict[int, tuple[list[tuple[int, int]], list[int]]] = {}  # task id -> (keys, slots)
    outcomes = {"ok": 0, "error": 0, "cancelled": 0, "too_small": 0}

    async def client(cid: int) -> None:
        for _ in range(6):
            layer = rng.randrange(3)
            experts = [rng.randrange(8) for _ in range(rng.randint(1, 3))]
            if rng.random() < 0.3:
                sched.prefetch(layer, [rng.randrange(8)])
            try:
                got = await sched.acquire(layer, experts)
            except ReadError:
                outcomes["error"] += 1
                continue
            except RingTooSmall:
                outcomes["too_small"] += 1
                continue
            if hint_rng.random() < 0.3:  # the router's near misses, as the engine passes them
                sched.hint(layer, [hint_rng.randrange(8) for _ in range(3)])
            keys = list(dict.fromkeys((layer, e) for e in experts))
            held[cid] = (keys, got)
            try:  # a client cancelled while it holds its slots still releases them
                for key, s in zip(keys, got, strict=True):
                    assert be.memory[s] == record_of(key), "handed a slot with the wrong record"
                await settle(rng.randint(0, 5))  # "compute" while holding
                for key, s in zip(keys, got, strict=True):
                    assert be.memory[s] == record_of(key), "a pinned slot was overwritten"
            finally:
                del held[cid]
                sched.release(got)
            outcomes["ok"] += 1

    tasks = [spawn(client(i)) for i in range(6)]
    for _ in range(3000):
        await asyncio.sleep(0)
        sched.check_invariants()
        for keys, got in held.values():
            for key, s in zip(keys, got, strict=True):
                assert s not in be.writing and be.memory[s] == record_of(key)
        if be.pending and rng.random() < 0.5:
            record = rng.choice(sorted(be.pending))
            error = OSError(5, "injected") if rng.random() < 0.1 else None
            be.complete(record, error)
        live = [t for t in tasks if not t.done()]
        if live and rng.random() < 0.01:
            rng.choice(live).cancel()
            outcomes["cancelled"] += 1
        if not live and not be.pending:
            break
    for t in tasks:
        if not t.done():
            t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    while be.pending:
        be.complete(next(iter(be.pending)))
        await settle()
    await sched.close()
    sched.check_invariants()
    assert all(pins == 0 for _, _, pins in sched.slot_table())
    assert outcomes["ok"] > 5, outcomes


async def test_a_key_goes_to_its_home_slot_when_it_is_empty():
    be = ControlledBackend(auto=True)
    sched = ExpertScheduler(
        8, be, record_of=record_of, record_bytes=100, workers=2, home=lambda k: 7 - k[1]
    )
    assert await sched.acquire(0, [0, 3]) == [7, 4]
    sched.prefetch(0, [1])
    await settle()
    assert sched.slot_of((0, 1)) == 6
    sched.check_invariants()


async def test_an_eviction_is_told_before_a_read_is_queued_into_its_slot():
    """``on_evict(key, slot)`` (a host tier's demotion) comes as a READY record leaves,
    before the read of the record that takes its slot is handed to the backend; a load
    that never completed (failed, dropped) is not an eviction."""
    events = []
    be = ControlledBackend(auto=True)
    original = be.read

    async def read(record, slot, priority=0):
        events.append(("read", record, slot))
        return await original(record, slot, priority)

    be.read = read
    sched = ExpertScheduler(
        2,
        be,
        record_of=record_of,
        record_bytes=100,
        on_evict=lambda key, slot: events.append(("evict", key, slot)),
    )
    sched.release(await sched.acquire(0, [1, 2]))
    sched.release(await sched.acquire(0, [3]))
    victim = next(e for e in events if e[0] == "evict")
    assert events.index(victim) < events.index(("read", 3, victim[2]))
    assert victim[1] in ((0, 1), (0, 2)) and len([e for e in events if e[0] == "evict"]) == 1
    sched.check_invariants()
