"""The expert scheduler: which record lives in which ring slot, and when it may be read.

Runs on one asyncio event loop; all state changes happen in plain (non-awaiting) code, so
no lock is needed. Rules it keeps (tests/test_sched_*.py check each):

- A pinned slot is never evicted, reassigned, or handed to a read for another record.
- A LOADING slot is never reassigned until its read has finished, even if cancelled.
- Workers take every queued DEMAND read before any SPECULATIVE one; a new demand read
  waits behind at most the reads already in flight. With a runway, reads are handed to the
  backend ahead of time (a worker takes its next read without waiting for the loop); the
  backend keeps demand first among them, and handed speculative reads never hold demand
  back.
- Two requests for one record share one read; a speculative read that becomes demanded
  is promoted (moved to the demand queue, or awaited if already in flight).
- Speculation only takes EMPTY or unpinned READY slots, never while demand waits for room.
- A request never waits for room while its task holds pins (no hold-and-wait), so
  requests cannot deadlock; what cannot be satisfied fails at once with RingTooSmall.
- A failed read fails every awaiter with ReadError (a SmoeError) and leaves its slot
  EMPTY. Pins have one owner, who releases them exactly once: the holder of a
  Reservation (whose waits never release), or ``acquire`` itself until it returns.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from smoe.sched.hints import takes_hints
from smoe.sched.policy import EvictionPolicy, make_policy
from smoe.sched.stats import SchedulerStats
from smoe.sched.types import Key, Priority, ReadBackend, ReadError, RingTooSmall, SlotState


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


@dataclass(eq=False)
class Reservation:
    """Pinned slots for one request, in the order the experts were asked for.

    Release ownership: whoever holds a Reservation releases it, exactly once, with
    ``release()``, whatever happened: the waits succeeded, raised ReadError, or were
    cancelled. ``wait()`` and ``wait_any()`` never release (the holder's ``finally``
    does); ``release()`` is idempotent only so that a ``finally`` may follow an early
    release. As an async context manager it waits on entry and releases on exit, also
    when the entry's wait raises or is cancelled.
    """

    scheduler: ExpertScheduler
    keys: list[Key]
    slots: list[int]
    owner: object
    released: bool = False
    _futures: list[asyncio.Future[None]] = field(default_factory=list)

    def ready(self) -> list[bool]:
        """Which of the slots are READY now (for computing on residents first)."""
        return [self.scheduler._slots[s].state is SlotState.READY for s in self.slots]

    async def wait(self) -> list[int]:
        """The slots, once every one is READY. Raises a failed read's ReadError as soon
        as one fails, or CancelledError; the slots stay pinned either way (the holder
        releases)."""
        while True:
            for f in self._futures:
                if f.done():
                    _raise_failure(f)
            pending = [f for f in self._futures if not f.done()]
            if not pending:
                return list(self.slots)
            # asyncio.wait never cancels the futures it waits on; awaiting them directly
            # would cancel the shared load when this one waiter is cancelled.
            await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)

    async def wait_any(self, positions: list[int]) -> list[int]:
        """Wait until at least one of ``positions`` (indices into the request) is READY;
        return all of them that are. A failed read among them raises its ReadError; as
        with ``wait``, nothing is released."""
        futures = [self._futures[p] for p in positions]
        if not any(f.done() for f in futures):
            await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
        done = []
        for p, f in zip(positions, futures, strict=True):
            if f.done():
                _raise_failure(f)
                done.append(p)
        return done

    def release(self) -> None:
        """Unpin the slots (the holder's single release; later calls do nothing)."""
        if not self.released:
            self.released = True
            self.scheduler._unpin(self.slots, self.owner)

    async def __aenter__(self) -> list[int]:
        try:
            return await self.wait()
        except BaseException:  # no __aexit__ follows a failed entry
            self.release()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self.release()


def _raise_failure(future: asyncio.Future[None]) -> None:
    """Raise what ended a done load's ``future`` unsuccessfully, if anything did."""
    if future.cancelled():
        raise asyncio.CancelledError
    error = future.exception()
    if error is not None:
        raise error


class ExpertScheduler:
    """Slot table, eviction, two priority queues and per-slot readiness over a backend.

    ``record_of(key)`` maps (layer, expert) to a vault record index; ``record_bytes`` is
    what one read moves (for statistics). ``workers`` bounds reads in flight; ``runway``
    more are handed to the backend ahead of time, so that a worker that finishes a read
    finds its next one at once (the backend must take demand before speculation).
    ``home(key)``: a slot to load ``key`` into when it is EMPTY (a ring that holds the whole
    model keeps each layer's experts together), or None for any.
    """

    def __init__(
        self,
        num_slots: int,
        backend: ReadBackend,
        *,
        record_of: Callable[[Key], int],
        record_bytes: int,
        workers: int = 4,
        runway: int = 0,
        policy: str | EvictionPolicy = "lru",
        clock: Callable[[], float] = time.perf_counter,
        home: Callable[[Key], int | None] | None = None,
    ) -> None:
        if num_slots < 1:
            raise ValueError("the ring needs at least one slot")
        if workers < 1:
            raise ValueError("at least one I/O worker is needed")
        if runway < 0:
            raise ValueError("the runway cannot be negative")
        self._slots = [Slot(i) for i in range(num_slots)]
        self._where: dict[Key, Slot] = {}
        self._queues: dict[Priority, deque[Slot]] = {p: deque() for p in Priority}
        self._backend = backend
        self._record_of = record_of
        self._record_bytes = record_bytes
        self._workers = workers
        self._runway = runway
        self._home = home
        self._in_flight = 0
        self._handed_speculative = 0  # of those in flight, handed as speculative reads
        self._tasks: set[asyncio.Task[None]] = set()
        self._room_waiters: list[asyncio.Future[None]] = []
        self._holdings: dict[object, Counter[int]] = {}  # owner -> pins per slot
        self._clock = clock
        self._closed = False
        self.policy: EvictionPolicy = make_policy(policy) if isinstance(policy, str) else policy
        self.stats = SchedulerStats()

    # ----------------------------------------------------------------- queries
    @property
    def num_slots(self) -> int:
        return len(self._slots)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def queue_depth(self, priority: Priority) -> int:
        return len(self._queues[priority])

    def state_of(self, key: Key) -> SlotState:
        slot = self._where.get(key)
        return slot.state if slot else SlotState.EMPTY

    def slot_of(self, key: Key) -> int | None:
        slot = self._where.get(key)
        return slot.index if slot else None

    def resident(self, layer: int) -> set[int]:
        """Experts of ``layer`` that are READY in the ring."""
        return {
            k[1] for k, s in self._where.items() if k[0] == layer and s.state is SlotState.READY
        }

    def holders(self) -> dict[object, int]:
        """Pins held, per owner (an empty dict when nothing is pinned)."""
        return {owner: sum(c.values()) for owner, c in self._holdings.items()}

    def fill(self) -> int:
        """Slots holding a record (READY or LOADING)."""
        return len(self._where)

    def slot_table(self) -> list[tuple[Key | None, SlotState, int]]:
        """(key, state, pins) of every slot, in slot order: a copy, for checks and tools."""
        return [(s.key, s.state, s.pins) for s in self._slots]

    def wrap_backend(self, wrap: Callable[[ReadBackend], ReadBackend]) -> ReadBackend:
        """Put ``wrap(backend)`` between the scheduler and its reads (recording them,
        delaying or reordering them, injecting faults); returns the new backend. Call it
        while no read is in flight (before the first request)."""
        self._backend = wrap(self._backend)
        return self._backend

    # ----------------------------------------------------------------- demand
    async def acquire(
        self,
        layer: int,
        experts: Iterable[int],
        priority: Priority = Priority.DEMAND,
        owner: object = None,
    ) -> list[int]:
        """Pin the slots of ``experts`` of ``layer`` and return them once all are READY.

        The slot ids follow the order of ``experts`` with duplicates removed. Pair with
        ``release(slots)``: once it returns, the caller owns the pins. Until then it owns
        them itself: cancelling the caller unpins everything it pinned (reads already in
        flight complete and stay cached), and so does a failed read before ReadError is
        raised. Raises RingTooSmall (at once) if the request can never fit.
        """
        reservation = await self.reserve(layer, experts, priority, owner)
        try:
            return await reservation.wait()
        except BaseException:  # the caller never saw the slots: this is their one release
            reservation.release()
            raise

    def release(self, slots: Iterable[int], owner: object = None) -> None:
        """Unpin slots returned by ``acquire``.

        ``owner`` defaults to the current task; pins are charged back to whoever holds
        them when that owner does not (e.g. a release from another task).
        """
        self._unpin(list(slots), owner if owner is not None else _owner())

    async def reserve(
        self,
        layer: int,
        experts: Iterable[int],
        priority: Priority = Priority.DEMAND,
        owner: object = None,
    ) -> Reservation:
        """Pin slots for ``experts`` and queue their reads; do not wait for the reads.
        The caller holds the returned Reservation and releases it once, whatever happens
        (see Reservation).

        Waits only for room (until other tasks release pins), and only while the calling
        task holds no pins of its own; otherwise a request that does not fit now raises
        RingTooSmall. Cancellation while waiting for room leaves nothing behind.
        ``owner`` (default: the current task) is who holds the pins: one engine sequence
        calling from several tasks passes one owner so hold-and-wait is recognised.
        """
        self._check_open()
        keys = list(dict.fromkeys((layer, int(e)) for e in experts))
        if len(keys) > self.num_slots:
            raise RingTooSmall(
                f"{len(keys)} experts were requested at once but the ring has only "
                f"{self.num_slots} slots; raise the memory budget",
                len(keys),
                self.num_slots,
            )
        owner = owner if owner is not None else _owner()
        while True:
            needed, free = self._room_for(keys, priority)
            if needed <= free:
                break
            held = sum(self._holdings.get(owner, Counter()).values())
            if held:
                raise RingTooSmall(
                    f"{needed} more slots are needed but only {free} can be freed while this "
                    f"task holds {held} pinned; release them first or raise the memory budget",
                    needed,
                    free,
                )
            await self._wait_for_room()
        return self._commit(keys, priority, owner)

    def prefetch(self, layer: int, experts: Iterable[int]) -> int:
        """Queue speculative reads for experts not in the ring; return how many were queued.

        Never evicts a pinned or LOADING slot, never runs ahead of demand, and does nothing
        while any demand request waits for room.
        """
        self._check_open()
        if self._room_waiters:
            return 0
        queued = 0
        for expert in dict.fromkeys(int(e) for e in experts):
            key = (layer, expert)
            if key in self._where:
                continue
            slot = self._free_slot(allow_cancel_speculative=False, exclude=(), key=key)
            if slot is None:
                break
            self._start_load(slot, key, Priority.SPECULATIVE)
            slot.speculative = True
            queued += 1
        self._pump()
        return queued

    @property
    def takes_hints(self) -> bool:
        """Whether the eviction policy uses ``hint`` (it implements ``on_hint``)."""
        return takes_hints(self.policy)

    def hint(self, layer: int, experts: Iterable[int]) -> int:
        """The router's near misses at ``layer``: experts ranked just below the ones the
        current request used (gate ranks top_k .. depth-1, ``smoe.sched.hints``). Each one
        in the ring (READY or LOADING) is passed, in the given order, to the policy's
        ``on_hint``, which makes it likelier to stay; the others are ignored. Not an access:
        no hit or miss is counted, nothing is read, pinned or evicted. Call it after the
        request's ``reserve``/``acquire`` and before the next request (as
        ``smoe.telemetry.replay`` does with ``hints=True``). Does nothing for a policy without
        ``on_hint``. Returns how many keys were passed on."""
        on_hint = getattr(self.policy, "on_hint", None)
        if self._closed or not callable(on_hint):
            return 0
        passed = 0
        for expert in dict.fromkeys(int(e) for e in experts):
            key = (layer, expert)
            if key in self._where:
                on_hint(key)
                passed += 1
        self.stats.hints += passed
        return passed

    def pin_ready(self, keys: Iterable[Key], owner: object) -> list[int] | None:
        """Pin the slots of ``keys`` for ``owner`` if every one is READY now (their slots,
        in order); else pin nothing and return None. Never waits, never reads."""
        self._check_open()
        wanted = list(dict.fromkeys(keys))
        found = [self._where.get(k) for k in wanted]
        if any(s is None or s.state is not SlotState.READY for s in found):
            return None
        slots = [s.index for s in found if s is not None]
        for s in found:
            assert s is not None
            s.pins += 1
        self._holdings.setdefault(owner, Counter()).update(slots)
        return slots

    def cancel_speculative(self, keep: Callable[[Key], bool] | None = None) -> int:
        """Drop queued (not yet started) speculative reads, except those ``keep`` accepts."""
        dropped = 0
        queue = self._queues[Priority.SPECULATIVE]
        for slot in list(queue):
            if keep is not None and slot.key is not None and keep(slot.key):
                continue
            queue.remove(slot)
            self._abandon(slot)
            self.stats.by_priority[Priority.SPECULATIVE].cancelled += 1
            dropped += 1
        if dropped:
            self._wake_room()
        return dropped

    async def drain(self) -> None:
        """Wait until no read is queued or in flight (queued reads start as others end).
        Requests made meanwhile may queue more; for replays and tests."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    async def close(self) -> None:
        """Stop taking requests, drop queued reads and wait for reads in flight to end."""
        self._closed = True
        for queue in self._queues.values():
            while queue:
                slot = queue.popleft()
                self._abandon(slot)
        if self._tasks:
            await asyncio.wait(list(self._tasks))

    # ----------------------------------------------------------------- internals
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the scheduler is closed")

    def _room_for(self, keys: list[Key], priority: Priority) -> tuple[int, int]:
        """(new slots the request needs, slots that could be given to it right now)."""
        wanted = set(keys)
        needed = sum(1 for k in keys if k not in self._where)
        free = 0
        for s in self._slots:
            if s.pins or (s.key is not None and s.key in wanted):
                continue
            if s.state is not SlotState.LOADING:
                free += 1
            elif (
                priority is Priority.DEMAND and not s.started and s.priority is Priority.SPECULATIVE
            ):
                free += 1  # a queued bet gives way to demand
        return needed, free

    def _commit(self, keys: list[Key], priority: Priority, owner: object) -> Reservation:
        slots: list[int] = []
        futures: list[asyncio.Future[None]] = []
        wanted = set(keys)
        for key in keys:
            slot = self._where.get(key)
            if slot is not None:
                self.stats.hits += 1
                if slot.speculative and priority is Priority.DEMAND:
                    slot.speculative = False
                    self.stats.speculative_used += 1
                if (
                    slot.state is SlotState.LOADING
                    and slot.priority is Priority.SPECULATIVE
                    and priority is Priority.DEMAND
                ):
                    self._promote(slot)
            else:
                self.stats.misses += 1
                slot = self._free_slot(
                    allow_cancel_speculative=priority is Priority.DEMAND, exclude=wanted, key=key
                )
                assert slot is not None, "room was checked before commit"
                self._start_load(slot, key, priority)
            self.policy.on_access(key)
            slot.pins += 1
            slots.append(slot.index)
            assert slot.loaded is not None
            futures.append(slot.loaded)
        self._holdings.setdefault(owner, Counter()).update(slots)
        self._pump()
        return Reservation(self, keys, slots, owner, _futures=futures)

    def _free_slot(
        self, *, allow_cancel_speculative: bool, exclude: Iterable[Key], key: Key | None = None
    ) -> Slot | None:
        """``key``'s home slot if it has one and it is EMPTY, else an EMPTY slot, else the
        policy's victim among unpinned READY ones, else (demand only) the slot of a queued
        speculative read, which is dropped."""
        if key is not None and self._home is not None:
            home = self._home(key)
            if home is not None and self._slots[home].state is SlotState.EMPTY:
                return self._slots[home]
        excluded = set(exclude)
        ready: dict[Key, Slot] = {}
        for s in self._slots:
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
            queue = self._queues[Priority.SPECULATIVE]
            for s in reversed(queue):  # the newest bet is the least likely to pay
                if s.key not in excluded:
                    queue.remove(s)
                    self._abandon(s)
                    self.stats.by_priority[Priority.SPECULATIVE].cancelled += 1
                    return s
        return None

    def _evict(self, slot: Slot) -> None:
        assert slot.pins == 0 and slot.state is SlotState.READY and slot.key is not None
        del self._where[slot.key]
        self.policy.on_remove(slot.key)
        slot.key, slot.state, slot.loaded, slot.speculative = None, SlotState.EMPTY, None, False
        self.stats.evictions += 1

    def _abandon(self, slot: Slot) -> None:
        """Forget a queued (never started) load: the slot becomes EMPTY."""
        assert not slot.started and slot.state is SlotState.LOADING and slot.key is not None
        del self._where[slot.key]
        self.policy.on_remove(slot.key)
        if slot.loaded is not None and not slot.loaded.done():
            slot.loaded.cancel()
        slot.key, slot.state, slot.loaded, slot.speculative = None, SlotState.EMPTY, None, False

    def _start_load(self, slot: Slot, key: Key, priority: Priority) -> None:
        assert slot.pins == 0 and slot.state is SlotState.EMPTY and slot.key is None
        slot.key, slot.state, slot.priority, slot.started = key, SlotState.LOADING, priority, False
        slot.loaded = asyncio.get_running_loop().create_future()
        slot.enqueued_at = self._clock()
        slot.speculative = False
        self._where[key] = slot
        self.policy.on_insert(key)
        self._queues[priority].append(slot)

    def _promote(self, slot: Slot) -> None:
        self.stats.promotions += 1
        if not slot.started:
            self._queues[Priority.SPECULATIVE].remove(slot)
            self._queues[Priority.DEMAND].append(slot)
        slot.priority = Priority.DEMAND

    def _limits(self) -> tuple[int, int]:
        """(most reads in flight for a demand read to be handed, the same for speculation).

        Up to ``runway`` handed reads may wait in the backend's queue; demand may be handed
        past the speculative ones among them, which the backend runs after it."""
        spec = self._workers + self._runway
        return spec + min(self._handed_speculative, self._runway), spec

    def _pump(self) -> None:
        """Hand queued reads to the backend, demand first, up to the limits in flight."""
        while True:
            demand_limit, spec_limit = self._limits()
            if self._queues[Priority.DEMAND] and self._in_flight < demand_limit:
                slot = self._queues[Priority.DEMAND].popleft()
            elif self._queues[Priority.SPECULATIVE] and self._in_flight < spec_limit:
                slot = self._queues[Priority.SPECULATIVE].popleft()
            else:
                return
            slot.started = True
            slot.handed_speculative = slot.priority is Priority.SPECULATIVE
            self._handed_speculative += slot.handed_speculative
            self._in_flight += 1
            task = asyncio.get_running_loop().create_task(self._run_read(slot))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run_read(self, slot: Slot) -> None:
        key, future, priority = slot.key, slot.loaded, slot.priority
        assert key is not None and future is not None
        counters = self.stats.by_priority[priority]
        started = self._clock()
        counters.queue_wait.add(started - slot.enqueued_at)
        record = self._record_of(key)
        try:
            nbytes = await self._backend.read(record, slot.index, int(slot.priority))
        except Exception as e:  # any failure of the read fails its awaiters
            self.stats.io_errors += 1
            del self._where[key]
            self.policy.on_remove(key)
            slot.key, slot.state, slot.loaded, slot.speculative = None, SlotState.EMPTY, None, False
            if not future.done():
                future.set_exception(ReadError(key, record, e))
                future.exception()  # mark retrieved: a bet may have no awaiter
        else:
            counters = self.stats.by_priority[slot.priority]  # may have been promoted
            counters.reads += 1
            counters.bytes += nbytes
            counters.read_latency.add(self._clock() - started)
            slot.state = SlotState.READY
            if not future.done():
                future.set_result(None)
        finally:
            slot.started = False
            self._in_flight -= 1
            self._handed_speculative -= slot.handed_speculative
            slot.handed_speculative = False
            if _loop_running():  # not when the loop is tearing this coroutine down
                self._pump()
                if slot.pins == 0:
                    self._wake_room()

    def _unpin(self, slots: list[int], owner: object) -> None:
        # Checked before anything changes, also under python -O (which drops asserts): a
        # negative pin count would let the slot be reused while a request computes on it.
        taken = Counter(slots)
        for index, n in taken.items():
            if self._slots[index].pins < n:
                raise RuntimeError(f"slot {index} released more often than pinned (a bug)")
        woke = False
        for index in slots:
            slot = self._slots[index]
            slot.pins -= 1
            if slot.pins == 0:
                woke = True
                if slot.state is SlotState.LOADING and not slot.started and not slot.speculative:
                    # Nobody wants this queued read any more: free its slot and the disk.
                    self._queues[slot.priority].remove(slot)
                    self._abandon(slot)
                    self.stats.by_priority[slot.priority].cancelled += 1
        for index in slots:
            self._charge_release(owner, index)
        if woke:
            self._wake_room()

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

    async def _wait_for_room(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._room_waiters.append(waiter)
        try:
            await waiter
        finally:
            if waiter in self._room_waiters:
                self._room_waiters.remove(waiter)

    def _wake_room(self) -> None:
        waiters, self._room_waiters = self._room_waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    # ----------------------------------------------------------------- checking
    def check_invariants(self) -> None:
        """Assert the slot table is consistent (tests call this after every step)."""
        seen: dict[Key, int] = {}
        queued = {id(s) for q in self._queues.values() for s in q}
        started = 0
        for s in self._slots:
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
        assert started == self._in_flight <= self._limits()[0]
        handed_spec = sum(s.handed_speculative for s in self._slots)
        assert handed_spec == self._handed_speculative <= self._in_flight
        pins: Counter[int] = Counter()
        for held in self._holdings.values():
            pins.update(held)
        assert all(pins[s.index] == s.pins for s in self._slots), "pins and holders disagree"


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _owner() -> object:
    task = asyncio.current_task()
    return task if task is not None else "no-task"
