"""Controlled fakes for deterministic concurrency tests.

``ControlledBackend`` is a ReadBackend whose reads complete only when the test says so,
and which keeps a fake ring memory so tests can check that every slot handed to a caller
holds the right record for as long as it is pinned.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass
class PendingRead:
    record: int
    slot: int
    done: asyncio.Future[None]


@dataclass
class ControlledBackend:
    record_bytes: int = 100
    started: list[tuple[int, int]] = field(default_factory=list)  # (record, slot) in order
    pending: dict[int, PendingRead] = field(default_factory=dict)  # by record
    memory: dict[int, int | None] = field(default_factory=dict)  # slot -> record it holds
    writing: set[int] = field(default_factory=set)  # slots a read is writing into now
    auto: bool = False  # complete reads as soon as they start

    async def read(self, record: int, slot: int, priority: int = 0) -> int:
        assert slot not in self.writing, f"two reads into slot {slot} at once"
        assert record not in self.pending, f"record {record} read twice at once"
        self.started.append((record, slot))
        self.writing.add(slot)
        self.memory[slot] = None  # the old contents are gone from the first byte
        done = asyncio.get_running_loop().create_future()
        self.pending[record] = PendingRead(record, slot, done)
        try:
            if self.auto:
                done.set_result(None)
            await done  # the test decides when (and how) this read ends
            self.memory[slot] = record
            return self.record_bytes
        finally:
            self.writing.discard(slot)
            del self.pending[record]

    def complete(self, record: int, error: BaseException | None = None) -> None:
        p = self.pending[record]
        if error is None:
            p.done.set_result(None)
        else:
            p.done.set_exception(error)

    def started_records(self) -> list[int]:
        return [r for r, _ in self.started]


async def settle(rounds: int = 50) -> None:
    """Let every ready task run until all are blocked (no real I/O, so this is exact)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


def record_of(key: tuple[int, int], experts_per_layer: int = 100) -> int:
    layer, expert = key
    return layer * experts_per_layer + expert


@dataclass
class QueuedBackend(ControlledBackend):
    """A ControlledBackend with ``workers`` workers and a queue in front of them, as
    DirectReader has: reads handed over beyond the workers wait, demand (priority 0)
    before speculation, and start (appear in ``started``) only when a worker is free."""

    workers: int = 1
    handed: list[int] = field(default_factory=list)  # records in the order handed over
    queued: tuple[list[tuple[int, asyncio.Future[None]]], ...] = field(
        default_factory=lambda: ([], [])
    )
    running: int = 0

    async def read(self, record: int, slot: int, priority: int = 0) -> int:
        self.handed.append(record)
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (record, gate)
        self.queued[priority].append(entry)
        self._dispatch()
        try:
            await gate
        except asyncio.CancelledError:
            if entry in self.queued[priority]:  # never started: dropped
                self.queued[priority].remove(entry)
                raise
            self.running -= 1  # started meanwhile: let it finish as a cancelled read
            self._dispatch()
            raise
        try:
            return await super().read(record, slot, priority)
        finally:
            self.running -= 1
            self._dispatch()

    def _dispatch(self) -> None:
        while self.running < self.workers:
            queue = self.queued[0] or self.queued[1]
            if not queue:
                return
            _, gate = queue.pop(0)
            self.running += 1
            gate.set_result(None)

    def waiting(self) -> list[int]:
        """Records handed over but not started, in the order they will start."""
        return [r for q in self.queued for r, _ in q]


class FailingReads:
    """Wraps a read backend (``ExpertScheduler.wrap_backend``): while ``failing`` is set,
    every read raises ``error`` (a disk going away), and ``failed`` counts them."""

    def __init__(self, inner, error: BaseException | None = None) -> None:
        self.inner = inner
        self.error = error or OSError("disk gone")
        self.failing = False
        self.failed = 0

    async def read(self, record: int, slot: int, priority: int = 0) -> int:
        if self.failing:
            self.failed += 1
            raise self.error
        return await self.inner.read(record, slot, priority)
