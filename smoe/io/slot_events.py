"""The staged ring's one ordered queue of slot events (smoe.io.staged): records landed for a
slot (from the disk, or a host tier's image) and demotions (a slot's content copied out to
a host image before it is overwritten). The compute thread applies them in queue order, in
runs that keep that order's meaning (``segments``), or drops them (``drop``) on close.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from smoe.vault.layout import Component


class SlotImage(Protocol):
    """A host copy of one slot, in the slots' dtypes (smoe.io.host_tier.HostImage)."""

    def component(self, c: Component, dtype: Any) -> Any:
        """Component ``c`` as a lazy [*shape] array in ``dtype`` (the slot's)."""
        ...

    def write(self, c: Component, data: np.ndarray) -> None:
        """Put component ``c``'s bytes (uint8, as the slot holds them) into the image."""
        ...


# ("land", slot, HostLanding or SlotImage, release()) or ("demote", slot, SlotImage, done(ok))
SlotEvent = tuple[str, int, Any, Callable[..., None]]
Run = tuple[list[SlotEvent], list[SlotEvent]]  # (landings, demotions)


def drop(event: SlotEvent) -> None:
    """An event that will never run: its landing released, its demotion told it failed."""
    if event[0] == "land":
        event[3]()
    else:
        event[3](False)


def segments(events: collections.deque[SlotEvent]) -> list[Run]:
    """Split queued events into runs that may be applied as (demotions, then landings):
    a run ends where a demotion would read a slot the run lands in, or a landing would
    overwrite a slot the run demotes."""
    runs: list[Run] = []
    lands: list[SlotEvent] = []
    demotions: list[SlotEvent] = []
    landed: set[int] = set()
    demoted: set[int] = set()
    for event in events:
        kind, slot = event[0], event[1]
        if (kind == "demote" and slot in landed) or (kind == "land" and slot in demoted):
            runs.append((lands, demotions))
            lands, demotions, landed, demoted = [], [], set(), set()
        (demotions if kind == "demote" else lands).append(event)
        (demoted if kind == "demote" else landed).add(slot)
    if lands or demotions:
        runs.append((lands, demotions))
    return runs
