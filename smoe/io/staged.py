"""The staged ring: expert slots in the compute device's memory, filled through host landings.

For a discrete GPU, and wherever the records are not in the compute dtype. The slots are one
contiguous array per component, ``[S, *shape]`` in the compute dtype (float components
converted, packed weights as they are): the form the kernels consume, so a matmul over the
ring never converts or copies it. A read goes:

    disk --preadv (O_DIRECT)--> landing buffer (host) --commit: MLX update--> slot (device)

- Landing buffers are a fixed pool of host MLX arrays (``landings`` of them, one record
  each: smoe.io.landings), allocated once; an I/O thread takes one and reads into it; the
  reader checks the landed bytes against the record's checksum and only then hands them
  over. With ``bounce`` the read goes into a per-thread aligned host buffer first and is
  copied into the landing: on CUDA, landings are managed memory, which O_DIRECT must not
  target (docs/gpu.md).
- The compute thread commits landed records: ``bank[name][local] = landing view`` (cast to
  the compute dtype) is an in-place ``slice_update`` on the compute stream. Any matmul built
  afterwards takes the updated array as input, so the device runs the copy first; no
  synchronisation beyond MLX's own graph is needed. The landing goes back to the pool once
  the update has been evaluated. Commits happen before every computation on ring slots and
  whenever the compute thread waits (``block_on``), so a landing is never held for long.
- In place, really: an update donates the array's buffer when nothing else references it.
  The ring holds the only Python reference (shared with the expert modules, whose
  parameters are these same objects), and every computation is evaluated before the next
  commit, so nothing does (tests/unit/test_staged.py checks MLX's memory counters).
- A host tier (smoe.io.host_tier) hands over its own host images of slots
  (``hand_over_image``: committed as landings are, the image's ``release`` called once
  copied) and asks for a slot's content before it is overwritten (``queue_demotion``).
  Both go through the one ordered queue of landings (smoe.io.slot_events), so a demotion
  copies what the slot held when it was queued, and an image is committed after whatever
  fills it.
- Banks: on a GPU MLX's kernels wrap their offsets past 2^31 bytes of an array, so the
  slots are split into banks whose arrays stay below that (whole MoE layers per bank where
  they fit); ``locate`` maps a slot id to (bank, slot in bank). A budget is never capped.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import mlx.core as mx
import numpy as np

from smoe.io.landings import HostLanding, StagedRead, aligned_host, make_landings
from smoe.io.ring import (
    GPU_MAX_ARRAY_BYTES,
    check_ring_args,
    is_float,
    landing_block,
    mx_dtype,
)
from smoe.io.slot_events import SlotEvent, SlotImage, drop, segments
from smoe.util.sizes import format_bytes
from smoe.vault.layout import RECORD_ALIGN, Component, RecordLayout
from smoe.vault.manifest import Manifest

T = TypeVar("T")


def staging_override() -> bool | None:
    """SMOE_STAGING=direct or bounce forces how reads reach the landings (docs/gpu.md);
    None when unset."""
    choice = os.environ.get("SMOE_STAGING", "")
    return {"direct": False, "bounce": True}.get(choice)


def target_dtype(c: Component, dtype: Any) -> Any:
    """The dtype a component is kept in: the compute dtype for floats, else its own."""
    return dtype if is_float(c.dtype) else mx_dtype(c.dtype)


class StagedRing:
    """``num_slots`` expert slots as per-component arrays on the compute device.

    ``dtype`` is the compute dtype float components are kept in. ``landings`` host buffers
    of one record each carry reads to the compute thread (at least one; the engine uses
    twice its I/O workers). ``max_bank_bytes`` caps each array's size (None: one bank);
    ``bank_align`` rounds a bank's slots down to its multiple. ``gpu_landings``: keep the
    landings on the host, mapped for a discrete GPU. ``bounce``: read into per-thread
    host buffers, then copy into the landing (None: only where landings could not be
    kept on the host).
    Build it on the compute thread (its arrays live on that thread's default device).
    """

    kind = "staged"

    def __init__(
        self,
        layout: RecordLayout,
        num_slots: int,
        dtype: Any,
        *,
        landings: int = 8,
        max_bank_bytes: int | None = None,
        bank_align: int = 1,
        gpu_landings: bool = False,
        bounce: bool | None = None,
    ) -> None:
        check_ring_args(layout, num_slots)
        if landings < 1:
            raise ValueError(f"a staged ring needs at least one landing buffer, got {landings}")
        self.layout = layout
        self.num_slots = num_slots
        self.stride = layout.stride
        self.dtype = dtype
        self._targets = [(c, target_dtype(c, dtype)) for c in layout.components]
        self.bank_slots = self._bank_slots(max_bank_bytes, bank_align)
        self._banks = self._make_banks()
        self.nbytes = num_slots * self.slot_bytes(layout, dtype)
        self._landings, self.landings_on_host = make_landings(landings, self.stride, gpu_landings)
        self.host_bytes = landings * (self.stride + RECORD_ALIGN)
        # Reads go through a per-thread bounce buffer only where landings could not be kept
        # on the host for a GPU (or when SMOE_STAGING says so).
        override = staging_override()
        if bounce is None:
            bounce = (
                override if override is not None else gpu_landings and not self.landings_on_host
            )
        self.bounce = bounce
        self.huge_pages = not gpu_landings
        self._bounce_buffers = threading.local()

        self._cond = threading.Condition()
        self._free: list[HostLanding] = list(self._landings)
        # In arrival order: ("land", slot, source, release) and ("demote", slot, image, done)
        # (smoe.io.slot_events).
        self._pending: collections.deque[SlotEvent] = collections.deque()
        self._closed = False
        self.on_landed: Callable[[], None] | None = None  # called (any thread) after a landing
        # Where the time goes (docs/performance.md): read by benchmarks.
        self.commits = 0
        self.demotions = 0  # slots copied out to a host image
        self.commit_seconds = 0.0  # compute thread, committing (and demoting)
        self.landing_wait_seconds = 0.0  # I/O threads, waiting for a free landing buffer
        self.waiting_for_landing = 0  # I/O threads waiting for one now

    def _bank_slots(self, max_bytes: int | None, align: int) -> int:
        """Slots per bank: all of them, or as many as keep every array below ``max_bytes``,
        rounded down to a multiple of ``align`` (whole MoE layers per bank where they fit:
        a layer's call then stays in one bank)."""
        if max_bytes is None:
            return self.num_slots
        per_slot = max(math.prod(c.shape) * int(t.size) for c, t in self._targets)
        if per_slot > max_bytes:
            raise ValueError(
                f"one expert's component takes {per_slot} bytes, more than a bank's {max_bytes}"
            )
        fit = max_bytes // per_slot
        if fit >= align > 1:
            fit -= fit % align
        return min(self.num_slots, fit)

    def _make_banks(self) -> list[dict[str, Any]]:
        """The slots: per bank, one zero-filled [S_b, *shape] array per component (zeros,
        so the memory is committed up front), evaluated."""
        sizes = [self.bank_slots] * (self.num_slots // self.bank_slots)
        if self.num_slots % self.bank_slots:
            sizes.append(self.num_slots % self.bank_slots)
        # A bank has at least 2 rows: MLX's slice_update returns the update itself when it
        # covers the whole array, which would make the bank alias a landing buffer.
        banks: list[dict[str, Any]] = [
            {c.name: mx.zeros((max(n, 2), *c.shape), t) for c, t in self._targets} for n in sizes
        ]
        mx.eval([list(b.values()) for b in banks])
        return banks

    @classmethod
    def for_vault(
        cls,
        manifest: Manifest,
        num_slots: int,
        dtype: Any,
        *,
        workers: int,
        gpu: bool,
        discrete: bool,
        max_bank_bytes: int | None = None,
    ) -> StagedRing:
        """The staged ring the engine builds for ``manifest`` on a device: landings for
        twice the I/O workers; on a GPU, arrays below 2^31 bytes (GPU_MAX_ARRAY_BYTES; whole
        MoE layers per bank where they fit); on a discrete GPU, landings kept on the host
        and mapped for it."""
        if max_bank_bytes is None and gpu:
            max_bank_bytes = GPU_MAX_ARRAY_BYTES
        return cls(
            manifest.record,
            num_slots,
            dtype,
            landings=2 * workers,
            max_bank_bytes=max_bank_bytes,
            bank_align=manifest.num_experts,
            gpu_landings=discrete,
        )

    @staticmethod
    def slot_bytes(layout: RecordLayout, dtype: Any) -> int:
        """Device memory one slot takes: each component in the dtype it is kept in."""
        return sum(math.prod(c.shape) * target_dtype(c, dtype).size for c in layout.components)

    # ------------------------------------------------------------------ I/O side
    def land(self, slot: int) -> StagedRead:
        """A free landing buffer for slot ``slot`` (blocks until one is): read into its
        ``memory`` (this thread's bounce buffer with ``bounce``), ``finish`` on the thread
        that read, then ``hand_over`` queues it for the commit, or ``discard`` gives it
        back. RuntimeError once the ring is closed."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range 0..{self.num_slots - 1}")
        land = self._take()
        bounce = self._bounce() if self.bounce else None
        return StagedRead(slot, land, bounce, self._hand_over, self._give_back)

    def landing(self, slot: int) -> AbstractContextManager[memoryview]:
        """``land`` as a block: handed over (unchecked) at its end, discarded if it raises."""
        return landing_block(self.land(slot))

    def _hand_over(self, slot: int, land: HostLanding) -> None:
        self._queue(("land", slot, land, lambda: self._give_back([land])))

    def hand_over_image(self, slot: int, image: SlotImage, release: Callable[[], None]) -> None:
        """Any thread: commit ``image`` (a host copy of a slot, in the slots' dtypes) into
        ``slot`` as a landing is; ``release()`` once it has been copied, or dropped (closed)."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range 0..{self.num_slots - 1}")
        self._queue(("land", slot, image, release))

    def queue_demotion(self, slot: int, image: SlotImage, done: Callable[[bool], None]) -> None:
        """Any thread: copy what ``slot`` holds now into ``image``, on the compute thread,
        before any landing queued after this call overwrites it. ``done(True)`` once copied;
        ``done(False)`` if the ring closed first."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range 0..{self.num_slots - 1}")
        self._queue(("demote", slot, image, done))

    def _queue(self, event: SlotEvent) -> None:
        with self._cond:
            if self._closed:
                drop(event)
                self._cond.notify_all()
                return
            self._pending.append(event)
            self._cond.notify_all()
        if self.on_landed is not None:
            self.on_landed()

    def _take(self) -> HostLanding:
        with self._cond:
            if not self._free and not self._closed:
                start = time.perf_counter()
                self.waiting_for_landing += 1
                while not self._free and not self._closed:
                    self._cond.wait()
                self.waiting_for_landing -= 1
                self.landing_wait_seconds += time.perf_counter() - start
            if self._closed:
                raise RuntimeError("the ring is closed")
            return self._free.pop()

    def _give_back(self, lands: list[HostLanding]) -> None:
        with self._cond:
            self._free.extend(lands)
            self._cond.notify_all()

    def _bounce(self) -> memoryview:
        """This I/O thread's own aligned host buffer (allocated once per thread)."""
        mine = getattr(self._bounce_buffers, "buffer", None)
        if mine is None:
            raw, mine = aligned_host(self.stride, huge=True)
            self._bounce_buffers.raw, self._bounce_buffers.buffer = raw, mine
        return mine

    # ------------------------------------------------------------------ compute side
    def commit(self) -> int:
        """Copy every landed record into its slot, and every queued demotion out of its
        slot, in the order they were queued (compute thread); return how many landed."""
        with self._cond:
            if not self._pending:
                return 0
            pending, self._pending = self._pending, collections.deque()
        start = time.perf_counter()
        committed = 0
        runs = segments(pending)
        try:
            while runs:
                lands, demotions = runs.pop(0)
                try:
                    self._demote(demotions)  # (their slots get no landing in this run)
                except BaseException:
                    runs.insert(0, (lands, demotions))
                    raise
                committed += self._land(lands)  # releases its landings, whatever happens
        finally:
            for lands, demotions in runs:  # what an error left: released, never applied
                for event in demotions + lands:
                    drop(event)
        self.commits += committed
        self.commit_seconds += time.perf_counter() - start
        return committed

    def _land(self, lands: list[SlotEvent]) -> int:
        """Apply one segment's landings (a slot landed twice keeps the last)."""
        latest: dict[int, SlotEvent] = {}
        stale: list[SlotEvent] = []
        for event in lands:
            if event[1] in latest:
                stale.append(latest[event[1]])
            latest[event[1]] = event
        touched: list[Any] = []
        try:
            for slot, (_, _, source, _) in latest.items():
                bank, local = self.locate(slot)
                arrays = self._banks[bank]
                for c, t in self._targets:
                    arrays[c.name][local] = source.component(c, t)
                    touched.append(arrays[c.name])
            mx.eval(touched)
        finally:
            del touched
            for event in stale + list(latest.values()):
                event[3]()
        return len(latest)

    def _demote(self, demotions: list[SlotEvent]) -> None:
        """Copy each demoted slot's arrays into its image (one evaluation for all)."""
        if not demotions:
            return
        parts = []
        for _, slot, image, _ in demotions:
            bank, local = self.locate(slot)
            for c, _t in self._targets:
                # A fresh array, written by the device: reading the bank from the host
                # would pull its pages over (MLX's CUDA memory is managed).
                part = self._banks[bank][c.name][local].reshape(-1).view(mx.uint8) + 0
                parts.append((image, c, part))
        mx.eval([x for _, _, x in parts])
        for image, c, x in parts:
            image.write(c, np.asarray(x))
        del parts  # (views of the banks: an update must find them unreferenced to donate)
        for _, _, _, done in demotions:
            done(True)
        self.demotions += len(demotions)

    def block_on(self, future: concurrent.futures.Future[T]) -> T:
        future.add_done_callback(lambda _: self._notify())
        while True:
            self.commit()
            with self._cond:
                while not future.done() and not self._pending:
                    self._cond.wait()
            if future.done():
                break
        self.commit()
        return future.result()

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def banks(self) -> list[dict[str, Any]]:
        return [dict(b) for b in self._banks]

    def locate(self, slot: int) -> tuple[int, int]:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range 0..{self.num_slots - 1}")
        return divmod(slot, self.bank_slots)

    def pending(self) -> int:
        """Records landed and not yet committed."""
        with self._cond:
            return len(self._pending)

    def close(self) -> None:
        """Refuse further landings, wake whoever waits for one, and drop the banks: their
        memory (a CUDA GPU's) goes now, not with the last reference to this ring; so do the
        landing buffers, but for those a read still in flight holds until it ends. Call it
        once the compute side has stopped committing."""
        with self._cond:
            self._closed = True
            for event in self._pending:
                drop(event)
            self._pending.clear()
            self._free.clear()  # _take refuses from now on
            self._banks, self._landings = [], []
            self._cond.notify_all()

    def __repr__(self) -> str:
        return (
            f"StagedRing({self.num_slots} slots in {len(self._banks)} bank(s), "
            f"{format_bytes(self.nbytes)} of {self.dtype}, {len(self._landings)} landings)"
        )
