"""The expert scheduler: which record lives in which ring slot, and when it may be read.

Runs on one asyncio event loop; all state changes happen in plain (non-awaiting) code, so
no lock is needed. The slot table (keys, slot states, queued loads, pins) and its
invariants are ``smoe.sched.slots``; this module makes requests wait for room or for
their reads and hands reads to the backend. Rules it keeps (tests/unit/test_sched.py check
each):

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from smoe.sched.hints import takes_hints
from smoe.sched.policy import EvictionPolicy, make_policy
from smoe.sched.slots import Slot, SlotTable
from smoe.sched.stats import SchedulerStats
from smoe.sched.types import Key, Priority, ReadBackend, ReadError, RingTooSmall, SlotState


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
        return [self.scheduler._table.is_ready(s) for s in self.slots]

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
    """Requests, room and reads over a slot table (eviction, two priority queues and
    per-slot readiness) and a read backend.

    ``record_of(key)`` maps (layer, expert) to a vault record index; ``record_bytes`` is
    what one read moves (for statistics). ``workers`` bounds reads in flight; ``runway``
    more are handed to the backend ahead of time, so that a worker that finishes a read
    finds its next one at once (the backend must take demand before speculation).
    ``home(key)``: a slot to load ``key`` into when it is EMPTY (a ring that holds the whole
    model keeps each layer's experts together), or None for any. ``on_evict(key, slot)``
    is called (on the loop) as a READY record is evicted, before a read for another is
    queued into its slot (a host tier demotes it then: smoe.io.host_tier).
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
        on_evict: Callable[[Key, int], None] | None = None,
    ) -> None:
        if num_slots < 1:
            raise ValueError("the ring needs at least one slot")
        if workers < 1:
            raise ValueError("at least one I/O worker is needed")
        if runway < 0:
            raise ValueError("the runway cannot be negative")
        self._table = SlotTable(
            num_slots,
            policy=make_policy(policy) if isinstance(policy, str) else policy,
            stats=SchedulerStats(),
            clock=clock,
            home=home,
            on_evict=on_evict,
        )
        self._backend = backend
        self._record_of = record_of
        self._record_bytes = record_bytes
        self._workers = workers
        self._runway = runway
        self._tasks: set[asyncio.Task[None]] = set()
        self._room_waiters: list[asyncio.Future[None]] = []
        self._clock = clock
        self._closed = False

    # ----------------------------------------------------------------- queries
    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy (the slot table's)."""
        return self._table.policy

    @property
    def stats(self) -> SchedulerStats:
        """Hits, misses, reads and latencies so far."""
        return self._table.stats

    @property
    def num_slots(self) -> int:
        return len(self._table.slots)

    @property
    def in_flight(self) -> int:
        return self._table.in_flight

    def queue_depth(self, priority: Priority) -> int:
        return self._table.queue_depth(priority)

    def state_of(self, key: Key) -> SlotState:
        slot = self._table.get(key)
        return slot.state if slot else SlotState.EMPTY

    def slot_of(self, key: Key) -> int | None:
        slot = self._table.get(key)
        return slot.index if slot else None

    def resident(self, layer: int) -> set[int]:
        """Experts of ``layer`` that are READY in the ring."""
        return self._table.resident(layer)

    def holders(self) -> dict[object, int]:
        """Pins held, per owner (an empty dict when nothing is pinned)."""
        return self._table.holders()

    def fill(self) -> int:
        """Slots holding a record (READY or LOADING)."""
        return self._table.fill()

    def waiting_for_room(self) -> int:
        """Requests waiting for a slot to be unpinned (a cancelled one leaves at once)."""
        return len(self._room_waiters)

    def slot_table(self) -> list[tuple[Key | None, SlotState, int]]:
        """(key, state, pins) of every slot, in slot order: a copy, for checks and tools."""
        return self._table.snapshot()

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
            needed, free = self._table.room_for(keys, priority)
            if needed <= free:
                break
            held = self._table.held_by(owner)
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
        while any demand request waits for room, or while recent bets were mostly wasted
        (``SpeculationGovernor``: a probe still goes through now and then).
        """
        self._check_open()
        if self._room_waiters:
            return 0
        if not self._table.governor.allows():  # recent bets did not pay (sched/governor.py)
            self.stats.speculative_declined += 1
            return 0
        queued = 0
        for expert in dict.fromkeys(int(e) for e in experts):
            key = (layer, expert)
            if key in self._table:
                continue
            slot = self._table.free_slot(allow_cancel_speculative=False, exclude=(), key=key)
            if slot is None:
                break
            self._table.start_load(slot, key, Priority.SPECULATIVE, speculative=True)
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
            if key in self._table:
                on_hint(key)
                passed += 1
        self.stats.hints += passed
        return passed

    def pin_ready(self, keys: Iterable[Key], owner: object) -> list[int] | None:
        """Pin the slots of ``keys`` for ``owner`` if every one is READY now (their slots,
        in order); else pin nothing and return None. Never waits, never reads."""
        self._check_open()
        return self._table.pin_ready(keys, owner)

    def cancel_speculative(self, keep: Callable[[Key], bool] | None = None) -> int:
        """Drop queued (not yet started) speculative reads, except those ``keep`` accepts."""
        dropped = 0
        for slot in self._table.queued_speculative():
            if keep is not None and slot.key is not None and keep(slot.key):
                continue
            self._table.drop_queued(slot)
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
        self._table.drop_all_queued()
        if self._tasks:
            await asyncio.wait(list(self._tasks))

    # ----------------------------------------------------------------- internals
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the scheduler is closed")

    def _commit(self, keys: list[Key], priority: Priority, owner: object) -> Reservation:
        slots, futures = self._table.pin_request(keys, priority, owner)
        self._pump()
        return Reservation(self, keys, slots, owner, _futures=futures)

    def _limits(self) -> tuple[int, int]:
        """(most reads in flight for a demand read to be handed, the same for speculation).

        Up to ``runway`` handed reads may wait in the backend's queue; demand may be handed
        past the speculative ones among them, which the backend runs after it."""
        spec = self._workers + self._runway
        return spec + min(self._table.handed_speculative, self._runway), spec

    def _pump(self) -> None:
        """Hand queued reads to the backend, demand first, up to the limits in flight."""
        while True:
            demand_limit, spec_limit = self._limits()
            in_flight = self._table.in_flight
            slot = self._table.hand_next(Priority.DEMAND) if in_flight < demand_limit else None
            if slot is None and in_flight < spec_limit:
                slot = self._table.hand_next(Priority.SPECULATIVE)
            if slot is None:
                return
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
            self._table.failed(slot)
            if not future.done():
                future.set_exception(ReadError(key, record, e))
                future.exception()  # mark retrieved: a bet may have no awaiter
        else:
            counters = self.stats.by_priority[slot.priority]  # may have been promoted
            counters.reads += 1
            counters.bytes += nbytes
            counters.read_latency.add(self._clock() - started)
            self._table.loaded(slot)
            if not future.done():
                future.set_result(None)
        finally:
            self._table.end_read(slot)
            if _loop_running():  # not when the loop is tearing this coroutine down
                self._pump()
                if slot.pins == 0:
                    self._wake_room()

    def _unpin(self, slots: list[int], owner: object) -> None:
        if self._table.unpin(slots, owner):
            self._wake_room()

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
        self._table.check_invariants()
        assert self._table.in_flight <= self._limits()[0]


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _owner() -> object:
    task = asyncio.current_task()
    return task if task is not None else "no-task"
