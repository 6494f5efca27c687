"""The host tier: host-memory copies of experts between a GPU's staged ring and the vault.

On a discrete GPU the ring lives in the GPU's memory and a record evicted from it would be
read from the disk again. The host tier keeps ``capacity`` slot images in host memory
(preallocated; on CUDA advised to stay on the host and be mapped for the GPU, as the
landings are), so such a miss is a copy over the bus instead of a disk read.

Which records it keeps (docs/cache-policy.md, "Two tiers": measured against Belady on the
demo's routing): exclusive in effect, with copies kept.
- A disk read goes to the ring only (through a landing, as without a tier).
- A ring eviction demotes the record: its slot is copied out into an image (the staged
  ring does it on the compute thread, before anything overwrites the slot), unless the
  tier still keeps a copy of it, which costs nothing.
- A tier hit is copied up (``StagedRing.hand_over_image``) and the image kept; a copy of a
  record the ring holds is free room, given up before anything else.
- Otherwise the victim is the image of least ``weight(record)`` (the ring's eviction
  policy's own book, so both tiers rank by one frequency count), else the oldest demoted.
Images hold the slot's form (float components in the compute dtype), so nothing converts
on the way up or down and the bits are the slot's. An image being filled (its demotion
queued) may be handed up: the ring runs both in the order they were queued.

Thread rules: every method may be called from any thread (one lock). ``demote`` is the
scheduler's eviction hook (event loop); ``take`` is the read backend's (``TieredReader``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from smoe.io.cuda_host import keep_on_host
from smoe.io.hugepages import advise_huge_pages
from smoe.io.staged import StagedRing, target_dtype
from smoe.vault.layout import Component, RecordLayout

ALIGN = 64  # each component's offset in an image (any dtype's view stays aligned)


def image_layout(layout: RecordLayout, dtype: Any) -> tuple[dict[str, int], int]:
    """Each component's byte offset in an image of a slot kept in ``dtype``, and the
    image's size."""
    offsets, end = {}, 0
    for c in layout.components:
        offsets[c.name] = end
        nbytes = math.prod(c.shape) * target_dtype(c, dtype).size
        end += -(-nbytes // ALIGN) * ALIGN
    return offsets, end


@dataclass(eq=False)
class HostImage:
    """One slot's bytes in host memory: ``array`` a uint8 MLX host array (the kernels read
    it when it is committed), ``view`` numpy's writable view of the same bytes."""

    array: Any  # mx.array [nbytes] uint8, host memory
    view: np.ndarray
    offsets: dict[str, int]

    def component(self, c: Component, dtype: Any) -> Any:
        start = self.offsets[c.name]
        nbytes = math.prod(c.shape) * dtype.size
        return self.array[start : start + nbytes].view(dtype).reshape(c.shape)

    def write(self, c: Component, data: np.ndarray) -> None:
        start = self.offsets[c.name]
        self.view[start : start + data.nbytes] = data


@dataclass
class _Entry:
    index: int  # which image
    record: int
    pins: int = 0  # copies up queued and not yet committed
    in_ring: bool = False  # the ring holds it too: free room
    filled: bool = False  # its demotion has run
    age: int = 0  # when it was demoted (the fallback order)


class HostTier:
    """``capacity`` host images of the slots of ``ring``. ``weight(record)``, where given,
    ranks what to keep (least goes first); None: the oldest demoted goes first."""

    def __init__(
        self,
        ring: StagedRing,
        capacity: int,
        gpu_mapped: bool = False,
        *,
        weight: Callable[[int], float] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"a host tier needs at least one image, got {capacity}")
        self.ring = ring
        self.capacity = capacity
        self.weight = weight
        self.offsets, self.image_bytes = image_layout(ring.layout, ring.dtype)
        self.nbytes = capacity * self.image_bytes
        self.on_host = gpu_mapped
        self._images = [self._make_image(gpu_mapped) for _ in range(capacity)]
        self._lock = threading.Lock()
        self._free = list(range(capacity - 1, -1, -1))
        self._where: dict[int, _Entry] = {}  # record -> its image
        # Free room found in O(1): filled, unpinned copies of records the ring holds.
        self._spare: dict[int, _Entry] = {}
        self._clock = 0
        # Counted for the stats and benchmarks (records; bytes are x image_bytes).
        self.hits = 0  # copies up
        self.demoted = 0  # copies down
        self.kept = 0  # demotions that found their copy kept (nothing moved)
        self.dropped = 0  # images given up for another record

    def _make_image(self, gpu_mapped: bool) -> HostImage:
        a = mx.zeros((self.image_bytes,), mx.uint8, stream=mx.cpu)
        mx.eval(a)
        view = np.asarray(a)  # writable: the MLX host buffer itself
        if gpu_mapped:
            self.on_host &= keep_on_host(int(view.ctypes.data), view.nbytes)
        else:
            advise_huge_pages(int(view.ctypes.data), view.nbytes)
        return HostImage(a, view, self.offsets)

    # ------------------------------------------------------------------ the ring's misses
    def take(self, record: int, slot: int) -> bool:
        """If the tier keeps ``record``, queue its copy up into ``slot`` and return True
        (the image stays, pinned until copied); else False (read it from the vault)."""
        with self._lock:
            entry = self._where.get(record)
            if entry is None:
                return False
            entry.pins += 1
            entry.in_ring = True
            self._spare.pop(record, None)
            self.hits += 1
        image = self._images[entry.index]
        self.ring.hand_over_image(slot, image, lambda: self._unpin(entry))
        return True

    def _unpin(self, entry: _Entry) -> None:
        with self._lock:
            entry.pins -= 1
            self._note_spare(entry)

    def _note_spare(self, entry: _Entry) -> None:
        """(Under the lock.) Keep ``_spare`` true for ``entry``."""
        if (
            entry.in_ring
            and entry.pins == 0
            and entry.filled
            and self._where.get(entry.record) is entry
        ):
            self._spare[entry.record] = entry
        else:
            self._spare.pop(entry.record, None)

    # ------------------------------------------------------------------ the ring's evictions
    def demote(self, record: int, slot: int) -> None:
        """``record`` is leaving ring slot ``slot``: keep it (a copy out of the slot,
        queued before anything can overwrite it), unless the tier keeps it already or
        every image is pinned or being filled."""
        with self._lock:
            entry = self._where.get(record)
            if entry is not None:  # its copy is kept: nothing moves
                entry.in_ring = False
                self._spare.pop(record, None)
                self.kept += 1
                return
            index = self._room()
            if index is None:
                return
            self._clock += 1
            entry = _Entry(index, record, age=self._clock)
            self._where[record] = entry
            self.demoted += 1
        self.ring.queue_demotion(slot, self._images[index], lambda ok: self._filled(entry, ok))

    def _filled(self, entry: _Entry, ok: bool) -> None:
        with self._lock:
            entry.filled = ok
            if not ok and self._where.get(entry.record) is entry:  # (the ring closed)
                del self._where[entry.record]
                self._free.append(entry.index)
            self._note_spare(entry)

    def _room(self) -> int | None:
        """A free image, else one given up (under the lock): a copy of a record the ring
        holds first, then the least weight (or oldest); never a pinned or unfilled one."""
        if self._free:
            return self._free.pop()
        if self._spare:
            victim = self._spare.pop(next(iter(self._spare)))
            del self._where[victim.record]
            self.dropped += 1
            return victim.index
        movable = [e for e in self._where.values() if e.pins == 0 and e.filled]
        if not movable:
            return None
        if self.weight is not None:
            weight = self.weight
            victim = min(movable, key=lambda e: (weight(e.record), e.age))
        else:
            victim = min(movable, key=lambda e: e.age)
        del self._where[victim.record]
        self.dropped += 1
        return victim.index

    def measure_bus(self, count: int, rounds: int = 3) -> float:
        """GB/s of copies up: ``count`` images committed into slots 0..count-1 at once,
        best of ``rounds`` (the compute thread; benchmarks only: the slots get the images'
        bytes, so the ring's records there are lost to anyone computing on it)."""
        import time

        count = min(count, self.capacity, self.ring.num_slots)
        best = float("inf")
        for _ in range(rounds):
            for slot in range(count):
                self.ring.hand_over_image(slot, self._images[slot], lambda: None)
            start = time.perf_counter()
            self.ring.commit()
            best = min(best, time.perf_counter() - start)
        return count * self.image_bytes / best / 1e9

    # ------------------------------------------------------------------ queries
    def holds(self, record: int) -> bool:
        with self._lock:
            return record in self._where

    def records(self) -> int:
        """Images holding a record (the ring's copies included)."""
        with self._lock:
            return len(self._where)

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (tests call it)."""
        with self._lock:
            used = {e.index for e in self._where.values()}
            assert len(used) == len(self._where), "two records share an image"
            assert not used & set(self._free), "an image is both used and free"
            assert len(used) + len(self._free) == self.capacity, "an image went missing"
            assert all(e.pins >= 0 for e in self._where.values())
            spare = {r for r, e in self._where.items() if e.in_ring and e.pins == 0 and e.filled}
            assert spare == set(self._spare), "the spare index is stale"

    def close(self) -> None:
        """Drop the images (after the ring has closed: nothing is queued any more)."""
        with self._lock:
            self._images = []
            self._where.clear()
            self._spare.clear()
            self._free = []

    def __repr__(self) -> str:
        return f"HostTier({self.capacity} images of {self.image_bytes} bytes)"


class TieredReader:
    """ReadBackend: a record the host tier keeps is copied up from it (no read; 0 bytes
    from the disk), any other is read by ``reader``. Closing stays the reader's owner's."""

    def __init__(self, tier: HostTier, reader: Any) -> None:
        self.tier = tier
        self.reader = reader

    async def read(self, record: int, slot: int, priority: int = 0) -> int:
        """As ``RecordReader.read``; a tier hit returns 0 at once (its copy queued on the
        ring, committed before any computation on the slot)."""
        if self.tier.take(record, slot):
            return 0
        result: int = await self.reader.read(record, slot, priority)
        return result
