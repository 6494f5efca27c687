"""The ring: one MLX allocation of S slots, each one record's bytes (docs/vault-format.md).

The I/O threads write records straight into slots through ``slot_memory`` (a writable
memoryview of the MLX buffer); the compute side reads them in place through ``views``,
per-component strided views ``[S, *shape]`` that share the ring's memory.

What MLX 0.32.4 does with such memory (tested in tests/test_io.py):
- Views read the bytes as they are when an op that uses them is *evaluated*, not when the
  op is built: a lazy op built before a write and evaluated after it sees the new bytes, and
  a result evaluated before a write keeps the old values. So a slot must not be rewritten
  while an unevaluated computation that reads it exists (the scheduler's pins guarantee it).
- Views stay valid across writes; they need not be recreated. ``mx.compile`` sees the new
  bytes too, for views passed as arguments and views captured by the compiled closure.
- ``view[s]`` with a bare integer index *copies* the slot (a gather); ``view[s, ...]``,
  ``view[s:s + 1]`` and ``mx.take(view, s, axis=0)`` are views. ``mx.gather_qmm`` with slot
  indices over the whole ``[S, ...]`` view reads in place.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np

from smoe.errors import SmoeError
from smoe.io.hugepages import advise_huge_pages
from smoe.units import format_bytes, parse_size
from smoe.vault.format import ITEMSIZE, RECORD_ALIGN, RecordLayout

# The ring starts at a 16 KiB boundary: O_DIRECT needs aligned buffers, and MLX's CPU
# allocations are not even page-aligned (one was at address % 4096 == 1176).
_ALIGN = RECORD_ALIGN


def mx_dtype(name: str) -> Any:
    """The MLX dtype of a manifest dtype name ('uint32', 'bfloat16', 'bool', ...)."""
    if name == "bool":
        return mx.bool_
    if name not in ITEMSIZE:
        raise ValueError(f"unsupported component dtype {name}")
    return getattr(mx, name)


def _suggest(nbytes: int) -> str:
    """A round --memory value >= nbytes: 84.9 MB -> '85MB', 1.23 GB -> '1.3GB'."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if nbytes >= scale:
            whole = -(-nbytes // scale)
            if whole >= 10:
                return f"{whole}{unit}"
            tenths = -(-nbytes * 10 // scale)
            return f"{tenths // 10}.{tenths % 10}{unit}" if tenths % 10 else f"{tenths // 10}{unit}"
    return f"{nbytes}B"


class Ring:
    """``num_slots`` slots of ``layout.stride`` bytes in one evaluated MLX uint8 array.

    The allocation is ``num_slots * stride + 16 KiB`` bytes, zero-filled (so its pages are
    committed up front); slot 0 starts at its first 16 KiB-aligned address. Nothing else
    is ever allocated: ``slot_memory`` and ``views`` only view this memory.
    """

    def __init__(self, layout: RecordLayout, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a ring needs at least one slot, got {num_slots}")
        if layout.stride <= 0 or layout.stride % _ALIGN:
            raise ValueError(f"record stride {layout.stride} is not a multiple of {_ALIGN}")
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

    @classmethod
    def for_budget(
        cls,
        layout: RecordLayout,
        memory: int | str,
        min_slots: int,
        *,
        max_slots: int | None = None,
        reason: str | None = None,
    ) -> Ring:
        """The largest ring that fits ``memory`` bytes (an int or '6GB'), capped at ``max_slots``.

        Raises SmoeError naming the smallest budget that works when ``memory`` holds fewer
        than ``min_slots`` slots; ``reason`` says why that many are needed (e.g. "one
        layer's top-8"). The 16 KiB alignment slack is not charged to the budget.
        """
        budget = parse_size(memory)
        slots = max(budget, 0) // layout.stride
        if slots < min_slots:
            need = min_slots * layout.stride
            shown = memory if isinstance(memory, str) else format_bytes(budget)
            why = reason or "the engine"
            raise SmoeError(
                f"a memory budget of {shown.strip()} holds {slots} expert slots of "
                f"{format_bytes(layout.stride)}; {why} needs at least {min_slots} slots = "
                f"{format_bytes(need)}: use --memory {_suggest(need)} or more"
            )
        if max_slots is not None:
            slots = min(slots, max(max_slots, min_slots))
        return cls(layout, slots)

    def slot_memory(self, slot: int) -> memoryview:
        """Slot ``slot``'s bytes: writable, 16 KiB-aligned, ``stride`` long. IndexError if out of range."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range 0..{self.num_slots - 1}")
        return self._memory[slot * self.stride : (slot + 1) * self.stride]

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
            f"Ring({self.num_slots} slots x {format_bytes(self.stride)} = "
            f"{format_bytes(self.nbytes)} at {self.address:#x})"
        )
