"""The slot table: which record lives in which ring slot, each slot's state, and its pins.

Plain synchronous bookkeeping for ``ExpertScheduler`` (``smoe.sched.scheduler``), which
does the waiting and hands the reads to the backend. A slot goes EMPTY -> LOADING (queued,
then started) -> READY, and back to EMPTY when it is evicted (READY and unpinned),
abandoned (queued and never started) or its read fails. Rules kept here
(``check_invariants`` asserts each):

- A key is in at most one slot; the key index holds exactly the slots that hold a key.
- An EMPTY slot holds no key. A LOADING slot's ``loaded`` future is pending, and its load
  is either queued (in the queue of its priority) or started, never both. A READY slot's
  load succeeded.
- Only unpinned slots are evicted, abandoned or given to another key; a slot's pins equal
  the pins charged to their owners.

No awaiting and no MLX here.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from smoe.sched.governor import SpeculationGovernor
from smoe.sched.policy import EvictionPolicy
from smoe.sched.stats import SchedulerStats
from smoe.sched.types import Key, Priority, SlotState


@dataclass(eq=False)
class Slot:
    index: int
    key: Key | None = None
    state: SlotState = SlotState.EMPTY
    pins: int = 0
    priority: Priority = Priority.DEMAND  # of the current load
    started: bool = False  # the read was handed to the backend
    handed_speculative: bool = False  # handed as a speculative read (the backend queues it so)
    loaded: asyncio.Future[None] | None = None  # done when the current load ends
    enqueued_at: float = 0.0
    speculative: bool = False  # loaded by a bet that no demand has used yet


class SlotTable:
    """``num_slots`` slots, the key index, the queues of loads not yet started, the pins
    per owner, and the count of loads started (in flight).

    ``policy`` is told of every insert, access and removal and picks eviction victims;
    ``stats`` counts evictions, hits and misses, promotions and cancelled loads; ``clock``
    stamps when a load was queued; ``home(key)`` is a slot to prefer for ``key`` when it
    is EMPTY (or None for any). Runs on the scheduler's event loop only (``start_load``
    makes a future of the running loop).
    """

    def __init__(
        self,
        num_slots: int,
        *,
        policy: EvictionPolicy,
        stats: SchedulerStats,
        clock: Callable[[], float],
        home: Callable[[Key], int | None] | None,
        on_evict: Callable[[Key, int], None] | None = None,
    ) -> None:
        self.slots = [Slot(i) for i in range(num_slots)]
        self.on_evict = on_evict  # told (key, slot) as a READY record is evicted
        self.policy = policy
        self.stats = stats
        self.governor = SpeculationGovernor()  # bets' outcomes: whether to take more
        self._where: dict[Key, Slot] = {}
        self._queues: dict[Priority, deque[Slot]] = {p: deque() for p in Priority}
        self._holdings: dict[object, Counter[int]] = {}  # owner -> pins per slot
        self._clock = clock
        self._home = home
        self._in_flight = 0
        self._handed_speculative = 0  # of those in flight, handed as speculative reads

    # ----------------------------------------------------------------- queries
    def __contains__(self, key: Key) -> bool:
        """Whether ``key`` is in a slot (READY or LOADING)."""
        return key in self._where

    def get(self, key: Key) -> Slot | None:
        return self._where.get(key)

    @property
    def in_flight(self) -> int:
        """Loads handed to the backend and not yet ended."""
        return self._in_flight

    @property
    def handed_speculative(self) -> int:
        """Of the loads in flight, those handed as speculative reads."""
        return self._handed_speculative

    def queue_depth(self, priority: Priority) -> int:
        return len(self._queues[priority])

    def is_ready(self, index: int) -> bool:
        return self.slots[index].state is SlotState.READY

    def resident(self, layer: int) -> set[int]:
        """Experts of ``layer`` that are READY."""
        return {
            k[1] for k, s in self._where.items() if k[0] == layer and s.state is SlotState.READY
        }

    def holders(self) -> dict[object, int]:
        """Pins held, per owner (an empty dict when nothing is pinned)."""
        return {owner: sum(c.values()) for owner, c in self._holdings.items()}

    def held_by(self, owner: object) -> int:
        """Pins ``owner`` holds."""
        return sum(self._holdings.get(owner, Counter()).values())

    def fill(self) -> int:
        """Slots holding a record (READY or LOADING)."""
        return len(self._where)

    def snapshot(self) -> list[tuple[Key | None, SlotState, int]]:
        """(key, state, pins) of every slot, in slot order: a copy."""
        return [(s.key, s.state, s.pins) for s in self.slots]

    def room_for(self, keys: list[Key], priority: Priority) -> tuple[int, int]:
        """(new slots the request needs, slots that could be given to it right now)."""
        wanted = set(keys)
        needed = sum(1 for k in keys if k not in self._where)
        free = 0
        for s in self.slots:
            if s.pins or (s.key is not None and s.key in wanted):
                continue
            if s.state is not SlotState.LOADING:
                free += 1
            elif (
                priority is Priority.DEMAND and not s.started and s.priority is Priority.SPECULATIVE
            ):
                free += 1  # a queued bet gives way to demand
        return needed, free

    # ----------------------------------------------------------------- pinning
    def pin_request(
        self, keys: list[Key], priority: Priority, owner: object
    ) -> tuple[list[int], list[asyncio.Future[None]]]:
        """Pin a slot for each of ``keys`` for ``owner``, queueing loads for the missing
        ones (evicting or dropping bets as ``free_slot`` does); return the slots and the
        futures of their loads. The caller checked with ``room_for`` that they fit."""
        slots: list[int] = []
        futures: list[asyncio.Future[None]] = []
        wanted = set(keys)
        for key in keys:
            slot = self._where.get(key)
            if slot is not None:
                self.stats.hits += 1
                if priority is Priority.DEMAND:
                    self._use_bet(slot)
            else:
                self.stats.misses += 1
                slot = self.free_slot(
                    allow_cancel_speculative=priority is Priority.DEMAND, exclude=wanted, key=key
                )
                assert slot is not None, "room was checked before commit"
                self.start_load(slot, key, priority)
            self.policy.on_access(key)
            slot.pins += 1
            slots.append(slot.index)
            assert slot.loaded is not None
            futures.append(slot.loaded)
        self._holdings.setdefault(owner, Counter()).update(slots)
        self.stats.pins += len(slots)
        return slots, futures

    def pin_ready(self, keys: Iterable[Key], owner: object) -> list[int] | None:
        """Pin the slots of ``keys`` for ``owner`` if every one is READY now (their slots,
        in order); else pin nothing and return None."""
        wanted = list(dict.fromkeys(keys))
        found = [self._where.get(k) for k in wanted]
        if any(s is None or s.state is not SlotState.READY for s in found):
            return None
        slots = [s.index for s in found if s is not None]
        for s in found:
            assert s is not None
            s.pins += 1
        self._holdings.setdefault(owner, Counter()).update(slots)
        self.stats.pins += len(slots)
        return slots

    def unpin(self, slots: list[int], owner: object) -> bool:
        """Unpin ``slots`` (charged to ``owner`` where it holds them, else to whoever does);
        a queued demand load nobody pins any more is dropped. True if a slot became
        unpinned. RuntimeError, before anything changes, if a slot would go below zero."""
        # Checked before anything changes, also under python -O (which drops asserts): a
        # negative pin count would let the slot be reused while a request computes on it.
        self.stats.unpins += len(slots)
        taken = Counter(slots)
        for index, n in taken.items():
            if self.slots[index].pins < n:
                raise RuntimeError(f"slot {index} released more often than pinned (a bug)")
        woke = False
        for index in slots:
            slot = self.slots[index]
            slot.pins -= 1
            if slot.pins == 0:
                woke = True
                if slot.state is SlotState.LOADING and not slot.started and not slot.speculative:
                    # Nobody wants this queued read any more: free its slot and the disk.
                    self.drop_queued(slot)
        for index in slots:
            self._charge_release(owner, index)
        return woke

    def _charge_release(self, owner: object, index: int) -> None:
        holders = [owner] if self._holdings.get(owner, Counter())[index] else []
        holders += [o for o, c in self._holdings.items() if c[index] and o is not owner]
        assert holders, f"slot {index} released but nobody holds it"
        held = self._holdings[holders[0]]
        held[index] -= 1
        if held[index] == 0:
            del held[index]
        if not held:
            del self._holdings[holders[0]]

    # ----------------------------------------------------------------- transitions
    def free_slot(
        self, *, allow_cancel_speculative: bool, exclude: Iterable[Key], key: Key | None = None
    ) -> Slot | None:
        """``key``'s home slot if it has one and it is EMPTY, else an EMPTY slot, else the
        policy's victim among unpinned READY ones, else (demand only) the slot of a queued
        speculative read, which is dropped."""
        if key is not None and self._home is not None:
            home = self._home(key)
            if home is not None and self.slots[home].state is SlotState.EMPTY:
                return self.slots[home]
        excluded = set(exclude)
        ready: dict[Key, Slot] = {}
        for s in self.slots:
            if s.pins:
                continue
            if s.state is SlotState.EMPTY:
                return s
            if s.state is SlotState.READY and s.key not in excluded:
                assert s.key is not None
                ready[s.key] = s
        if ready:
            victim = ready[self.policy.victim(ready.keys())]
            self._evict(victim)
            return victim
        if allow_cancel_speculative:
            for s in reversed(self._queues[Priority.SPECULATIVE]):  # the newest bet pays least
                if s.key not in excluded:
                    self.drop_queued(s)
                    return s
        return None

    def start_load(
        self, slot: Slot, key: Key, priority: Priority, *, speculative: bool = False
    ) -> None:
        """Queue a load of ``key`` into EMPTY ``slot`` (``speculative``: a bet, not demand)."""
        assert slot.pins == 0 and slot.state is SlotState.EMPTY and slot.key is None
        slot.key, slot.state, slot.priority, slot.started = key, SlotState.LOADING, priority, False
        slot.loaded = asyncio.get_running_loop().create_future()
        slot.enqueued_at = self._clock()
        slot.speculative = speculative
        self._where[key] = slot
        self.policy.on_insert(key)
        self._queues[priority].append(slot)

    def _use_bet(self, slot: Slot) -> None:
        """Demand asked for ``slot``'s key: a bet that loaded it paid, and a speculative
        load of it that is still queued or in flight becomes a demand one."""
        if slot.speculative:
            slot.speculative = False
            self.stats.speculative_used += 1
            self.governor.outcome(used=True)
        if slot.state is SlotState.LOADING and slot.priority is Priority.SPECULATIVE:
            self.stats.promotions += 1
            if not slot.started:
                self._queues[Priority.SPECULATIVE].remove(slot)
                self._queues[Priority.DEMAND].append(slot)
            slot.priority = Priority.DEMAND

    def hand_next(self, priority: Priority) -> Slot | None:
        """Start the oldest queued load of ``priority``, if any (the caller hands its read
        to the backend and calls ``end_read`` when it ends)."""
        queue = self._queues[priority]
        if not queue:
            return None
        slot = queue.popleft()
        slot.started = True
        slot.handed_speculative = slot.priority is Priority.SPECULATIVE
        self._handed_speculative += slot.handed_speculative
        self._in_flight += 1
        return slot

    def loaded(self, slot: Slot) -> None:
        """``slot``'s read succeeded: it is READY."""
        slot.state = SlotState.READY

    def failed(self, slot: Slot) -> None:
        """``slot``'s read failed: forget its key; the slot becomes EMPTY."""
        assert slot.key is not None
        del self._where[slot.key]
        self.policy.on_remove(slot.key)
        self._empty(slot)

    def end_read(self, slot: Slot) -> None:
        """``slot``'s read ended (after ``loaded`` or ``failed``): it is no longer in flight."""
        slot.started = False
        self._in_flight -= 1
        self._handed_speculative -= slot.handed_speculative
        slot.handed_speculative = False

    def queued_speculative(self) -> list[Slot]:
        """The queued (not started) speculative loads, oldest first: a copy."""
        return list(self._queues[Priority.SPECULATIVE])

    def drop_queued(self, slot: Slot) -> None:
        """Drop ``slot``'s queued (never started) load, counted as cancelled."""
        self._queues[slot.priority].remove(slot)
        self._abandon(slot)
        self.stats.by_priority[slot.priority].cancelled += 1

    def drop_all_queued(self) -> None:
        """Drop every queued load (closing: not counted as cancelled)."""
        for queue in self._queues.values():
            while queue:
                self._abandon(queue.popleft())

    def _evict(self, slot: Slot) -> None:
        assert slot.pins == 0 and slot.state is SlotState.READY and slot.key is not None
        if slot.speculative:  # a bet read and never asked for
            self.stats.speculative_wasted += 1
            self.governor.outcome(used=False)
        key = slot.key
        del self._where[key]
        self.policy.on_remove(key)
        self._empty(slot)
        self.stats.evictions += 1
        if self.on_evict is not None:  # before anything is queued into the slot
            self.on_evict(key, slot.index)

    def _abandon(self, slot: Slot) -> None:
        """Forget a queued (never started) load: the slot becomes EMPTY."""
        assert not slot.started and slot.state is SlotState.LOADING and slot.key is not None
        del self._where[slot.key]
        self.policy.on_remove(slot.key)
        if slot.loaded is not None and not slot.loaded.done():
            slot.loaded.cancel()
        self._empty(slot)

    @staticmethod
    def _empty(slot: Slot) -> None:
        slot.key, slot.state, slot.loaded, slot.speculative = None, SlotState.EMPTY, None, False

    # ----------------------------------------------------------------- checking
    def check_invariants(self) -> None:
        """Assert the table is consistent (see the module docstring)."""
        seen: dict[Key, int] = {}
        queued = {id(s) for q in self._queues.values() for s in q}
        started = 0
        for s in self.slots:
            assert s.pins >= 0
            if s.key is not None:
                assert s.key not in seen, f"{s.key} in two slots"
                seen[s.key] = s.index
                assert self._where.get(s.key) is s
                assert s.state is not SlotState.EMPTY
            else:
                assert s.state is SlotState.EMPTY
            if s.state is SlotState.LOADING:
                assert s.loaded is not None and not s.loaded.done()
                assert s.started != (id(s) in queued), "a load is either queued or in flight"
                started += s.started
            else:
                assert id(s) not in queued and not s.started
            if s.state is SlotState.READY:
                assert s.loaded is not None and s.loaded.done() and s.loaded.exception() is None
        assert set(seen) == set(self._where)
        assert started == self._in_flight
        handed_spec = sum(s.handed_speculative for s in self.slots)
        assert handed_spec == self._handed_speculative <= self._in_flight
        pins: Counter[int] = Counter()
        for held in self._holdings.values():
            pins.update(held)
        assert all(pins[s.index] == s.pins for s in self.slots), "pins and holders disagree"
