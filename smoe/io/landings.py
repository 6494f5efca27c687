"""The host side of a staged ring (smoe.io.staged): the landing buffers records are read into
before the compute thread commits them to device slots, and one read's way into a buffer.

- ``HostLanding``: one host buffer of one record, an MLX array on the CPU stream (on CUDA,
  managed memory), so a commit reads it without a copy; ``make_landings`` allocates the pool.
- ``StagedRead``: one read on its way to a slot (the ring's ``Landing``): into the landing,
  or into the reading thread's bounce buffer (``aligned_host``) and copied over after.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from smoe.io.cuda_host import keep_on_host
from smoe.io.hugepages import HUGE_PAGE, advise_huge_pages
from smoe.io.ring import mx_dtype
from smoe.vault.layout import RECORD_ALIGN, Component


@dataclass(eq=False)
class HostLanding:
    """One host buffer a record lands in: ``memory`` is its aligned ``stride`` bytes."""

    array: Any  # mx.array [rows, 16 KiB] uint8, evaluated, host memory
    memory: memoryview
    start: int  # bytes from the array's start to ``memory``

    def component(self, c: Component, dtype: Any) -> Any:
        """The landed bytes of component ``c`` as a lazy [*shape] array in ``dtype``."""
        flat = self.array.reshape(-1)
        begin = self.start + c.offset
        a = flat[begin : begin + c.nbytes].view(mx_dtype(c.dtype)).reshape(c.shape)
        return a if a.dtype == dtype else a.astype(dtype)


def make_landings(count: int, stride: int, gpu_landings: bool) -> tuple[list[HostLanding], bool]:
    """``count`` landing buffers of ``stride`` bytes in host memory (the CPU stream's
    allocations; on CUDA, managed memory, with ``gpu_landings`` advised to stay on the host
    and be mapped for the GPU: smoe.io.cuda_host), and whether every one of those stayed on
    the host."""
    lands: list[HostLanding] = []
    on_host = gpu_landings
    for _ in range(count):
        a = mx.zeros((stride // RECORD_ALIGN + 1, RECORD_ALIGN), mx.uint8, stream=mx.cpu)
        mx.eval(a)
        flat = np.asarray(a).reshape(-1)  # writable view of the MLX host buffer
        start = (-int(flat.ctypes.data)) % RECORD_ALIGN
        if gpu_landings:
            on_host &= keep_on_host(int(flat.ctypes.data), flat.nbytes)
        else:  # O_DIRECT lands here: huge pages make it ~2.5x faster
            advise_huge_pages(int(flat.ctypes.data), flat.nbytes)
        lands.append(HostLanding(a, flat[start : start + stride].data, start))
    return lands, on_host


def aligned_host(nbytes: int, *, huge: bool) -> tuple[np.ndarray, memoryview]:
    """A numpy buffer and its 16 KiB-aligned window of ``nbytes`` (huge pages if asked)."""
    pad = HUGE_PAGE if huge else RECORD_ALIGN
    raw = np.zeros(nbytes + pad, dtype=np.uint8)
    start = (-int(raw.ctypes.data)) % pad
    if huge:
        advise_huge_pages(int(raw.ctypes.data), raw.nbytes)
    return raw, raw[start : start + nbytes].data


class StagedRead:
    """One read on its way to a slot of a StagedRing (the ring's ``Landing``). The ring
    passes how a finished read is queued for its commit (``hand_over(slot, landing)``) and
    how an unused landing goes back to its pool (``give_back([landing])``)."""

    def __init__(
        self,
        slot: int,
        land: HostLanding,
        bounce: memoryview | None,
        hand_over: Callable[[int, HostLanding], None],
        give_back: Callable[[list[HostLanding]], None],
    ) -> None:
        self._slot = slot
        self._land: HostLanding | None = land
        self._bounce = bounce
        self._hand_over = hand_over
        self._give_back = give_back
        self.memory = bounce if bounce is not None else land.memory

    def finish(self) -> memoryview:
        """On the thread that read: a bounced read is copied into the landing here (a CPU
        copy: managed memory stays coherent), so that thread's bounce buffer is free."""
        assert self._land is not None, "finish after hand_over or discard"
        if self._bounce is not None:
            self._land.memory[:] = self._bounce
            self._bounce = None
        return self._land.memory

    def hand_over(self) -> None:
        land, self._land = self._land, None
        assert land is not None and self._bounce is None, "hand_over needs a finished read"
        self._hand_over(self._slot, land)

    def discard(self) -> None:
        land, self._land = self._land, None
        if land is not None:
            self._give_back([land])
