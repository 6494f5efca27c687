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
