"""What the allocators may keep beside the memory in use, bounded where ``--memory`` is a
promise (issue 49; docs/plan.md, "What the allocators keep").

The budget counts what is live (backbone, KV, ring, a pass's activations) and the buffers
MLX keeps for the next pass. Two allocators kept more than that, and how much more
depended on the order the threads ran in:

- glibc's malloc (under MLX's CPU allocator, numpy and Python) raises its mmap threshold
  to the size of each large block freed, up to 32 MiB, after which blocks of up to that
  size come from its heaps, where a freed one stays as a hole until something of a size
  that fits is asked for: 60-70 MB of such free space at the end of a `smoe generate` of
  the 2-layer Qwen3-30B-geometry vault, its amount varying from run to run. ``bound_malloc``
  fixes the threshold at 1 MiB (``M_MMAP_THRESHOLD``, which also stops it moving), so a
  block that large is its own mapping, given back to the kernel when freed, and caps the
  arenas (``M_ARENA_MAX``), which every thread that allocates would otherwise add up to
  8 per core of. (At glibc's starting 128 KiB the peak was 3-6 MB lower, but a prompt
  chunk's [64, hidden] activations became fresh mappings each time: prefill about 15%
  slower, in page faults; docs/plan.md.)
- MLX's buffer cache (32 MB by default on the CPU) keeps freed buffers for reuse; the
  budget counts ``allocator_cache_bytes`` for them (smoe.plan.budget), and
  ``limit_mlx_cache`` caps MLX's cache at that figure.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameters (malloc.h)
M_ARENA_MAX = -8
MMAP_THRESHOLD = 1 << 20  # fixed; glibc starts at 128 KiB and moves it up to 32 MiB
ARENA_MAX = 2

_lock = threading.Lock()
_bounded: bool | None = None


def bound_malloc() -> bool:
    """Fix glibc malloc's mmap threshold at MMAP_THRESHOLD and cap its arenas at ARENA_MAX
    (module docstring), once per process; best called before threads start (an arena cap
    binds the threads that allocate after it). Returns whether it took effect: False where
    the C library is not glibc (musl, macOS), which is left as it is."""
    global _bounded
    with _lock:
        if _bounded is None:
            _bounded = _mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and _mallopt(
                M_ARENA_MAX, ARENA_MAX
            )
        return _bounded


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError, AttributeError):  # not a glibc system
        return False


def _mallopt(param: int, value: int) -> bool:
    if not _glibc():
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(param, value))  # 1 on success


def limit_mlx_cache(nbytes: int) -> int:
    """Cap MLX's buffer cache at ``nbytes`` (freeing what it holds above that); returns the
    limit it had, for the caller to restore."""
    import mlx.core as mx

    previous: Any = mx.set_cache_limit(int(nbytes))
    return int(previous)
