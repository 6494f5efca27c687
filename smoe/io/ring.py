"""The ring: the preallocated expert slots, seen by the I/O threads and by the kernels.

One interface, two backends, chosen by where the kernels read memory from:

- ``UnifiedRing`` (smoe/io/unified.py): memory the CPU and the kernels share (the CPU
  backend, Apple's unified memory). A read lands straight in its slot; the kernels read the
  slot in place. It needs the vault's float components to be in the compute dtype already.
- ``StagedRing`` (smoe/io/staged.py): one contiguous array per component in the compute
  dtype, in the compute device's own memory (a discrete GPU's). A read lands in a host
  landing buffer; the compute thread copies it into its slot with an MLX update that the
  device orders before any matmul that reads the slot.

Both are used the same way:

    I/O thread:      land = ring.land(slot); preadv(fd, [land.memory], offset)
                     data = land.finish()                # the bytes the slot will get
                     land.hand_over() (verified) or land.discard()   # any thread
                     (or: with ring.landing(slot) as memory: preadv(...), handed over at exit)
    compute thread:  result = ring.block_on(future)   # wait, committing landed reads
                     ring.commit()                    # before computing on READY slots
                     ring.banks()[b][name]            # [S_b, *shape] arrays for the kernels
                     ring.locate(slot) -> (b, local)  # which array holds a slot
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol, TypeVar

import mlx.core as mx

from smoe.vault.layout import ITEMSIZE, RECORD_ALIGN, RecordLayout

T = TypeVar("T")

# MLX 0.32.4's CUDA gather_qmm (its tiled kernel) wraps its offsets past 2^31 bytes of one
# weight array: measured on an H200, 680 slots of 4-bit [1536, 4096] (2.14 GB) computed right
# and 688 (2.16 GB) wrong (bench/gpu_probe.py). A staged ring on a GPU keeps every array below.
GPU_MAX_ARRAY_BYTES = 2**31 - 1


def mx_dtype(name: str) -> Any:
    """The MLX dtype of a manifest dtype name ('uint32', 'bfloat16', 'bool', ...)."""
    if name == "bool":
        return mx.bool_
    if name not in ITEMSIZE:
        raise ValueError(f"unsupported component dtype {name}")
    return getattr(mx, name)


def is_float(dtype_name: str) -> bool:
    return dtype_name in ("float16", "bfloat16", "float32")


def needs_conversion(layout: RecordLayout, dtype: Any) -> bool:
    """Whether some float component of the records is not in ``dtype`` (the compute dtype).

    Kernels given scales or weights of another dtype than the activations convert the
    whole array they are given on every call: over a ring that is a cost that grows with
    the ring (measured: bf16 scales with float32 activations, 3 MB -> 100 MB touched per
    call from 16 to 512 slots). Such records must be converted once, when they land.
    """
    return any(is_float(c.dtype) and mx_dtype(c.dtype) != dtype for c in layout.components)


def check_ring_args(layout: RecordLayout, num_slots: int) -> None:
    """ValueError unless there is a slot and records are whole 16 KiB blocks (O_DIRECT)."""
    if num_slots < 1:
        raise ValueError(f"a ring needs at least one slot, got {num_slots}")
    if layout.stride <= 0 or layout.stride % RECORD_ALIGN:
        raise ValueError(f"record stride {layout.stride} is not a multiple of {RECORD_ALIGN}")


def slot_size(ring: ExpertRing) -> int:
    """Memory one slot of ``ring`` takes: the record stride in a unified ring, the device
    arrays of one expert in a staged one (the per-slot figure the budget divides by)."""
    return ring.nbytes // ring.num_slots


class Landing(Protocol):
    """Where one read of one slot goes (``ExpertRing.land``), until it is handed over.

    Nothing reaches the slot (a staged ring commits nothing) before ``hand_over``, so the
    reader can check the bytes first: the thread that read calls ``finish`` (a bounce
    buffer is copied into the landing there, so that thread may read again at once);
    any thread then calls ``hand_over`` or ``discard``, once.
    """

    memory: memoryview  # where to read: ``stride`` bytes, 16 KiB aligned

    def finish(self) -> memoryview:
        """The read is done: the bytes as the slot will get them (``stride`` long)."""
        ...

    def hand_over(self) -> None:
        """Give the bytes to the slot (a staged ring queues its commit). Once the ring is
        closed the landing is just freed."""
        ...

    def discard(self) -> None:
        """Drop the bytes: the landing buffer goes back to the pool (idempotent; after a
        ``hand_over`` it does nothing). A unified ring's slot then holds junk, which no
        one computes on: the slot is not READY."""
        ...


class ExpertRing(Protocol):
    """What the reader, the scheduler's users and the expert module need of a ring."""

    kind: str  # "unified" or "staged"
    layout: RecordLayout  # the vault's record layout (what one read moves)
    num_slots: int
    stride: int  # bytes one read moves: the vault's record stride
    nbytes: int  # memory the slots take (the budget's subject)
    huge_pages: bool  # whether the kernel was asked to back the slots with huge pages

    def land(self, slot: int) -> Landing:
        """I/O thread: a Landing for ``slot``'s next record. May block until a landing
        buffer is free (staged ring); RuntimeError once the ring is closed."""
        ...

    def landing(self, slot: int) -> AbstractContextManager[memoryview]:
        """``land`` as a block: where to read ``slot``'s next record (``stride`` bytes, 16
        KiB aligned). Leaving the block normally hands the bytes to the slot unchecked;
        an exception discards them."""
        ...

    def commit(self) -> int:
        """Compute thread: make every landed record visible to the kernels; returns how
        many were committed (0 for a unified ring, where reads land in place)."""
        ...

    def block_on(self, future: concurrent.futures.Future[T]) -> T:
        """Compute thread: wait for ``future`` (e.g. a reservation on the event loop),
        committing records as they land meanwhile, then return its result (or raise its
        exception). Every record landed before ``future`` completed is committed."""
        ...

    def banks(self) -> list[dict[str, Any]]:
        """Per bank, {component: mx.array [S_b, *shape]} for the kernels, in place."""
        ...

    def locate(self, slot: int) -> tuple[int, int]:
        """(bank, slot within the bank) of a global slot id."""
        ...

    def close(self) -> None:
        """Stop taking landings (waiters get RuntimeError) and drop uncommitted ones."""
        ...


OnLanded = Callable[[], None]


@contextmanager
def landing_block(land: Landing) -> Iterator[memoryview]:
    """``land``'s memory as a block: handed over when the block ends normally, discarded
    when it raises (the ``landing`` of both rings)."""
    try:
        yield land.memory
        land.finish()
    except BaseException:
        land.discard()
        raise
    land.hand_over()
