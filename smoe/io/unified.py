"""The unified-memory ring: one MLX allocation of S slots, each one record's bytes.

For memory the CPU and the kernels share (the CPU backend; Apple's unified memory). The I/O
threads read records straight into slots through ``slot_memory`` (a writable memoryview of
the MLX buffer); the kernels read them in place through ``views``, per-component strided
views ``[S, *shape]`` over the ring's memory. Nothing is copied or converted, so the
records' float components must already be in the compute dtype (smoe.io.ring.needs_conversion
says when they are not; the staged ring then converts each record once, when it lands).

What MLX 0.32.4 does with such memory (tested in tests/unit/test_io.py):
- Views read the bytes as they are when an op that uses them is *evaluated*, not when the
  op is built: a lazy op built before a write and evaluated after it sees the new bytes, and
  a result evaluated before a write keeps the old values. So a slot must not be rewritten
  while an unevaluated computation that reads it exists (the scheduler's pins guarantee it).
- Views stay valid across writes; they need not be recreated. ``mx.compile`` sees the new
  bytes too, for views passed as arguments and views captured by the compiled closure.
- ``view[s]`` with a bare integer index *copies* the slot (a gather); ``view[s, ...]``,
  ``view[s:s + 1]`` and ``mx.take(view, s, axis=0)`` are views. ``mx.gather_qmm`` with slot
  indices over the whole ``[S, ...]`` view reads in place.
- On CUDA this memory must not be used: taking a buffer's address moves it to managed
  memory, and the kernels did not reliably see slots rewritten that way (docs/gpu.md).
"""

from __future__ import annotations

import concurrent.futures
import math
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import mlx.core as mx
import numpy as np

from smoe.io.hugepages import advise_huge_pages
from smoe.io.ring import check_ring_args, landing_block, mx_dtype
from smoe.util.sizes import format_bytes
from smoe.vault.layout import ITEMSIZE, RECORD_ALIGN, RecordLayout

T = TypeVar("T")

# The ring starts at a 16 KiB boundary: O_DIRECT needs aligned buffers, and MLX's CPU
# allocations are not even page-aligned (one was at address % 4096 == 1176).
_ALIGN = RECORD_ALIGN


class _InPlace:
    """A read straight into its slot: nothing to copy, hand over or give back. The slot
    is READY only once the reader says so, so a discarded read's bytes are never used."""

    def __init__(self, memory: memoryview) -> None:
        self.memory = memory

    def finish(self) -> memoryview:
        return self.memory

    def hand_over(self) -> None:
        pass

    def discard(self) -> None:
        pass


class UnifiedRing:
    """``num_slots`` slots of ``layout.stride`` bytes in one evaluated MLX uint8 array.

    The allocation is ``num_slots * stride + 16 KiB`` bytes, zero-filled (so its pages are
    committed up front); slot 0 starts at its first 16 KiB-aligned address. Nothing else
    is ever allocated: ``slot_memory`` and ``views`` only view this memory.
    """

    kind = "unified"

    def __init__(self, layout: RecordLayout, num_slots: int) -> None:
        check_ring_args(layout, num_slots)
        self.layout = layout
        self.num_slots = num_slots
        self.stride = layout.stride
        self.nbytes = num_slots * layout.stride  # the slots; allocated_bytes adds the slack
        self.allocated_bytes = self.nbytes + _ALIGN
        # Rows of 16 KiB: an MLX shape dimension is a 32-bit int, so one flat dimension
        # would cap the ring at 2 GiB.
        self._buffer: Any = mx.zeros((self.allocated_bytes // _ALIGN, _ALIGN), mx.uint8)
        mx.eval(self._buffer)
        # np.asarray views the MLX buffer (no copy), writable: reads land in the MLX array.
        whole = np.asarray(self._buffer).reshape(-1)
        base = int(whole.ctypes.data)
        if base % max(ITEMSIZE.values()):
            raise RuntimeError(f"MLX allocation at {base:#x} is not 8-byte aligned")
        self._start = (-base) % _ALIGN  # bytes from the allocation to slot 0
        self.address = base + self._start
        self.huge_pages = advise_huge_pages(base, self.allocated_bytes)
        self._memory: memoryview = whole[self._start : self._start + self.nbytes].data
        self._views = self._build_views()

    @staticmethod
    def slot_bytes(layout: RecordLayout) -> int:
        """Memory one slot takes: one record, padding included."""
        return layout.stride

    # ------------------------------------------------------------------ I/O side
    def slot_memory(self, slot: int) -> memoryview:
        """Slot ``slot``'s bytes: writable, 16 KiB-aligned, ``stride`` long. IndexError if out of range."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range 0..{self.num_slots - 1}")
        return self._memory[slot * self.stride : (slot + 1) * self.stride]

    def land(self, slot: int) -> _InPlace:
        """The slot itself: a read lands in place (nothing to hand over afterwards)."""
        return _InPlace(self.slot_memory(slot))

    def landing(self, slot: int) -> AbstractContextManager[memoryview]:
        return landing_block(self.land(slot))

    # ------------------------------------------------------------------ compute side
    def commit(self) -> int:
        return 0  # reads land in place

    def block_on(self, future: concurrent.futures.Future[T]) -> T:
        return future.result()

    def banks(self) -> list[dict[str, Any]]:
        return [self.views()]

    def locate(self, slot: int) -> tuple[int, int]:
        return 0, slot

    def close(self) -> None:
        pass

    def views(self) -> dict[str, Any]:
        """{component name: evaluated mx.array [S, *shape]} over the ring, without copying.

        The views stay valid for the ring's life and show the slots' bytes as they are when
        an op that reads them is evaluated (module docstring). Index a slot with
        ``view[s, ...]``; a bare ``view[s]`` copies.
        """
        return dict(self._views)

    def _build_views(self) -> dict[str, Any]:
        views: dict[str, Any] = {}
        for c in self.layout.components:
            itemsize = ITEMSIZE[c.dtype]
            # as_strided flattens its input, and MLX sizes a flat dimension with a 32-bit
            # int, so it gets the buffer's first row only (same address; as_strided reads
            # past its input's shape by design). The view stays inside the allocation.
            flat = self._buffer[:1].view(mx_dtype(c.dtype))
            # view: [S, *shape]; slot s, element idx at flat[offset + s*slot_elems + row-major(idx)]
            inner = [math.prod(c.shape[i + 1 :]) for i in range(len(c.shape))]
            views[c.name] = mx.as_strided(
                flat,
                shape=(self.num_slots, *c.shape),
                strides=(self.stride // itemsize, *inner),
                offset=(self._start + c.offset) // itemsize,
            )
        mx.eval(*views.values())
        return views

    def __repr__(self) -> str:
        return (
            f"UnifiedRing({self.num_slots} slots x {format_bytes(self.stride)} = "
            f"{format_bytes(self.nbytes)} at {self.address:#x})"
        )
