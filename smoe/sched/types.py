"""Vocabulary shared by the scheduler, its backends and its users. No MLX here."""

from __future__ import annotations

from enum import Enum, IntEnum
from typing import Protocol

Key = tuple[int, int]  # (decoder layer, expert)


class Priority(IntEnum):
    """Read priority; workers always take DEMAND before SPECULATIVE."""

    DEMAND = 0
    SPECULATIVE = 1


class SlotState(Enum):
    EMPTY = "empty"  # holds nothing usable
    LOADING = "loading"  # a read is queued or in flight into it
    READY = "ready"  # holds its record; stays cached after release


class RingTooSmall(ValueError):
    """One request needs more slots than the ring has (or than can ever be freed for it)."""

    def __init__(self, message: str, needed: int, available: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available


class ReadError(OSError):
    """Reading a record failed; the message names the (layer, expert) and record."""

    def __init__(self, key: Key, record: int, cause: BaseException) -> None:
        layer, expert = key
        super().__init__(
            f"reading expert {expert} of layer {layer} (record {record}) failed: {cause}"
        )
        self.key = key
        self.record = record
        self.cause = cause


class ReadBackend(Protocol):
    """Moves one record's bytes into one ring slot.

    ``read`` returns the number of bytes read, or raises. It must not return or raise while
    its worker may still write into the slot, even when the awaiting task is cancelled: the
    scheduler reuses the slot as soon as ``read`` finishes. ``priority`` is the read's
    ``Priority`` when it was handed over: a backend that queues reads (a scheduler with a
    runway hands it more than it has workers) must start DEMAND ones first.
    """

    async def read(self, record: int, slot: int, priority: int = 0) -> int: ...
