"""The compute thread and its bridge to the event loop.

MLX streams belong to the thread that made them, so one thread owns every MLX call: the
model, the KV caches, the expert matmuls. When a MoE layer needs experts, that thread asks
the scheduler (which lives on the event loop) and blocks until the slots are READY.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import anyio

from smoe.io.ring import ExpertRing
from smoe.sched.scheduler import ExpertScheduler, Reservation

T = TypeVar("T")


class LoopLease:
    """Pinned slots from ``LoopSlots.reserve`` (a smoe.compute.streaming.Lease): ``ready[i]``
    says slot i was READY already.

    The compute code that reserved it releases it, exactly once, with ``release()`` in a
    ``finally``: after computing, after ``wait``/``wait_any`` raised (they never release),
    and after any other error. Later ``release()`` calls do nothing.
    """

    def __init__(self, source: LoopSlots, reservation: Reservation, ready: list[bool]) -> None:
        self._source = source
        self._reservation = reservation
        self.slots = list(reservation.slots)
        self.ready = ready
        self.released = False

    def wait(self) -> None:
        """Block until every slot is READY. Raises ReadError (a SmoeError) if a read
        failed; the slots stay pinned until ``release()``."""
        if not all(self.ready):
            self._source._wait(self._reservation.wait())
            self.ready = [True] * len(self.slots)

    def wait_any(self, positions: list[int]) -> list[int]:
        """Block until some of ``positions`` are READY; return those that are. Raises as
        ``wait`` does, releasing nothing."""
        done: list[int] = self._source._wait(self._reservation.wait_any(positions))
        for p in done:
            self.ready[p] = True
        return done

    def release(self) -> None:
        """Unpin the slots (on the loop, before the next request from this thread runs)."""
        if not self.released:
            self.released = True
            self._source.loop.call_soon_threadsafe(self._reservation.release)


class LoopSlots:
    """A SlotSource for the compute thread, backed by the scheduler on ``loop``.

    ``acquire`` blocks the compute thread (never the loop) until every slot is READY and
    measures how long it waited: the time the computation spent waiting on I/O. While it
    waits, and before it returns, the ring commits what has landed (``ExpertRing.block_on``),
    so a slot handed to the computation always holds its record where the kernels read.
    """

    def __init__(
        self,
        scheduler: ExpertScheduler,
        loop: asyncio.AbstractEventLoop,
        ring: ExpertRing | None = None,
        every_key: list[tuple[int, int]] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.loop = loop
        self.ring = ring
        self.wait_seconds = 0.0
        self.acquires = 0
        # Every (layer, expert) of the vault: once all are READY (a ring that holds the
        # whole model) they are pinned for good and served from device tables.
        self._every_key = every_key
        self._resident: dict[int, Any] | None = None  # layer -> (bank, [E] uint32 slots)
        self._resident_slots: dict[tuple[int, int], int] | None = None  # set on the loop
        self.resident_hits = 0

    def acquire(self, layer: int, experts: list[int]) -> list[int]:
        """The slots once all are READY; the caller then owns them (``release(slots)``).
        If the wait raises (ReadError), the pins were released here."""
        lease = self.reserve(layer, experts)
        try:
            lease.wait()
        except BaseException:
            lease.release()
            raise
        return lease.slots

    def reserve(self, layer: int, experts: list[int]) -> LoopLease:
        """Pin slots and queue the misses; return at once (the reads go on). The caller
        owns the lease and releases it once (``LoopLease.release``), whatever happens."""
        self.acquires += 1
        reservation, ready = self._wait(self._reserve(layer, experts))
        if self._resident is None and self._resident_slots is not None:
            self._install_resident_tables(self._resident_slots)
        return LoopLease(self, reservation, ready)

    async def _reserve(self, layer: int, experts: list[int]) -> tuple[Reservation, list[bool]]:
        """On the loop: the reservation and which of its slots are READY, read together.
        A slot read as READY landed before this returned, so the ring commits it before
        ``_wait`` does (a snapshot taken later, from this thread, could see a slot READY
        whose landing is not committed yet). A pinned READY slot cannot change after.
        Once the ring holds every expert, they are pinned for good here."""
        reservation = await self.scheduler.reserve(layer, experts, owner=self)
        try:
            every = self._every_key
            if (
                every is not None
                and self._resident_slots is None
                and self.scheduler.fill() == len(every)
            ):
                slots = self.scheduler.pin_ready(every, owner=RESIDENT)
                if slots is not None:
                    self._resident_slots = dict(zip(every, slots, strict=True))
            return reservation, reservation.ready()
        except BaseException:  # the LoopLease is never made: its release is ours
            reservation.release()
            raise

    def _install_resident_tables(self, slots: dict[tuple[int, int], int]) -> None:
        """Compute thread: per layer whose experts share one bank, that bank and the device
        table expert -> slot in it (layers split across banks keep the reserving path)."""
        import mlx.core as mx

        self._resident = {}
        if self.ring is None:
            return
        experts = 1 + max(e for _, e in slots)
        by_layer: dict[int, list[tuple[int, int]]] = {}
        for (layer, expert), slot in slots.items():
            by_layer.setdefault(layer, [(0, 0)] * experts)[expert] = self.ring.locate(slot)
        for layer, located in by_layer.items():
            banks = {bank for bank, _ in located}
            if len(banks) == 1:
                table = mx.array([local for _, local in located], dtype=mx.uint32)
                self._resident[layer] = (banks.pop(), table)

    def all_resident(self, layers: int) -> bool:
        """Whether each of the model's ``layers`` MoE layers has a resident table (a forward
        pass then needs no slot from the scheduler)."""
        return self._resident is not None and len(self._resident) == layers

    def resident_table(self, layer: int) -> Any:
        return None if self._resident is None else self._resident.get(layer)

    def count_resident(self, unique_experts: int) -> None:
        self.resident_hits += unique_experts

    def _wait(self, coro: Coroutine[Any, Any, T]) -> T:
        start = time.perf_counter()
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
            return self.ring.block_on(future) if self.ring is not None else future.result()
        finally:
            self.wait_seconds += time.perf_counter() - start

    def release(self, slots: list[int]) -> None:
        """Unpin slots returned by ``acquire`` (a LoopLease is released with its own method)."""
        # FIFO with the next acquire's submission: the slots are free before it asks.
        self.loop.call_soon_threadsafe(self.scheduler.release, slots, self)

    def capacity(self) -> int:
        return self.scheduler.num_slots

    def prefetch(self, layer: int, experts: list[int]) -> None:
        self.loop.call_soon_threadsafe(self.scheduler.prefetch, layer, experts)

    def cancel_speculative(self) -> None:
        self.loop.call_soon_threadsafe(self.scheduler.cancel_speculative)


RESIDENT = "resident"  # the owner of the pins that keep a whole model in the ring


class ComputeThread:
    """One thread, one job at a time. ``run`` awaits a job without blocking the loop.

    A job cannot be interrupted once it runs: cancelling ``run``'s caller abandons the
    result, and the next job starts only after it has finished.
    """

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="smoe-compute")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Queue a job without waiting for it (after the jobs already queued)."""
        return self._pool.submit(fn, *args)

    async def close(self) -> None:
        # Wait in another thread: a running job may still need the loop for its slots.
        await anyio.to_thread.run_sync(self._shutdown)

    def _shutdown(self) -> None:
        try:
            tid = self._pool.submit(threading.get_native_id)  # after the queued jobs
        except RuntimeError:  # closed already
            return
        self._pool.shutdown(True)
        _wait_gone(tid.result())


def _wait_gone(tid: int, timeout: float = 5.0) -> None:
    """Until the OS thread ``tid`` has exited (Linux; elsewhere nothing is waited for).

    A pool's shutdown (Thread.join) returns once Python is done with its thread, before
    the thread's C++ thread_local destructors run. MLX's take the GIL: one still running
    when the interpreter finalizes is ended by it inside a noexcept destructor, which is
    std::terminate ("terminate called without an active exception", exit 134). An engine
    that failed to open (a bad tokenizer file) and exited at once met that one run in two.
    """
    task = f"/proc/self/task/{tid}"
    end = time.monotonic() + timeout
    while os.path.exists(task) and time.monotonic() < end:
        time.sleep(0.001)
