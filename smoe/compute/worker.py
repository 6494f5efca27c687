"""The compute thread and its bridge to the event loop.

MLX streams belong to the thread that made them, so one thread owns every MLX call: the
model, the KV caches, the expert matmuls. When a MoE layer needs experts, that thread asks
the scheduler (which lives on the event loop) and blocks until the slots are READY.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import Any, TypeVar

from smoe.sched.scheduler import ExpertScheduler

T = TypeVar("T")


class LoopSlots:
    """A SlotSource for the compute thread, backed by the scheduler on ``loop``.

    ``acquire`` blocks the compute thread (never the loop) until every slot is READY and
    measures how long it waited: the time the computation spent waiting on I/O.
    """

    def __init__(self, scheduler: ExpertScheduler, loop: asyncio.AbstractEventLoop) -> None:
        self.scheduler = scheduler
        self.loop = loop
        self.wait_seconds = 0.0
        self.acquires = 0

    def acquire(self, layer: int, experts: list[int]) -> list[int]:
        start = time.perf_counter()
        future = asyncio.run_coroutine_threadsafe(
            self.scheduler.acquire(layer, experts, owner=self), self.loop
        )
        try:
            return future.result()
        finally:
            self.wait_seconds += time.perf_counter() - start
            self.acquires += 1

    def release(self, slots: list[int]) -> None:
        # FIFO with the next acquire's submission: the slots are free before it asks.
        self.loop.call_soon_threadsafe(self.scheduler.release, slots, self)

    def capacity(self) -> int:
        return self.scheduler.num_slots


class ComputeThread:
    """One thread, one job at a time. ``run`` awaits a job without blocking the loop.

    A job cannot be interrupted once it runs: cancelling ``run``'s caller abandons the
    result, and the next job starts only after it has finished.
    """

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="smoe-compute")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def close(self) -> None:
        # Wait in another thread: a running job may still need the loop for its slots.
        await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown, True)
