"""Vocabulary shared by the scheduler, its backends and its users. No MLX here."""

from __future__ import annotations

from enum import Enum, IntEnum
from typing import Protocol

from smoe.errors import ExpertReadError, SmoeError

Key = tuple[int, int]  # (decoder layer, expert)


class Priority(IntEnum):
    """Read priority; workers always take DEMAND before SPECULATIVE."""

    DEMAND = 0
    SPECULATIVE = 1


class SlotState(Enum):
    EMPTY = "empty"  # holds nothing usable
    LOADING = "loading"  # a read is queued or in flight into it
    READY = "ready"  # holds its record; stays cached after release


class RingTooSmall(SmoeError, ValueError):
    """One request needs more slots than the ring has (or than can ever be freed for it):
    a SmoeError, since a larger --memory (or fewer concurrent requests) fixes it."""

    def __init__(self, message: str, needed: int, available: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available


# Reading a record failed: a SmoeError (one line naming the expert, the record and the fix;
# the backend's exception is ``cause``). Defined with the other user-facing errors.
ReadError = ExpertReadError


class ReadBackend(Protocol):
    """Moves one record's bytes into one ring slot.

    ``read`` returns the number of bytes read once the slot holds the record (verified,
    where the backend checks records), or raises; the scheduler then fails every awaiter
    of the read with ReadError and never marks its slot READY. It must not return or raise
    while its worker may still write into the slot, even when the awaiting task is
    cancelled: the scheduler reuses the slot as soon as ``read`` finishes. ``priority`` is the read's
    ``Priority`` when it was handed over: a backend that queues reads (a scheduler with a
    runway hands it more than it has workers) must start DEMAND ones first.
    """

    async def read(self, record: int, slot: int, priority: int = 0) -> int: ...
