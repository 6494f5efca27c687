"""Keep a CUDA managed-memory buffer in host memory, mapped for the GPU (the CUDA runtime,
through ctypes; MLX has no API for it).

MLX's CUDA build allocates host-side arrays (the staged ring's landing buffers) as managed
memory, which migrates page by page to whichever processor touched it last. A landing is
written by the disk (host) and read by the GPU's copy kernel, then written again: without
advice every record ping-pongs, measured at ~3.5 GB/s for the copy into the slot and slower
reads. Advising "preferred location: host; accessed by: the GPU" keeps the pages in host
memory and maps them for the GPU, which then reads them over the bus like pinned memory.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

_ADVISE_SET_PREFERRED_LOCATION = 3  # cudaMemAdviseSetPreferredLocation
_ADVISE_SET_ACCESSED_BY = 5  # cudaMemAdviseSetAccessedBy
_LOCATION_DEVICE = 1  # cudaMemLocationTypeDevice
_LOCATION_HOST = 2  # cudaMemLocationTypeHost


class _MemLocation(ctypes.Structure):  # struct cudaMemLocation (CUDA 13)
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


def _runtime() -> ctypes.CDLL | None:
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cudaMemAdvise.restype = ctypes.c_int
        return lib
    return None


def keep_on_host(address: int, nbytes: int, device: int = 0) -> bool:
    """Advise the managed range [address, address + nbytes) to live in host memory and be
    mapped for GPU ``device``. Returns whether the CUDA runtime accepted both pieces of
    advice; never raises (without them the buffer still works, only slower)."""
    lib = _runtime()
    if lib is None:
        return False
    ptr, size = ctypes.c_void_p(address), ctypes.c_size_t(nbytes)
    try:
        host = lib.cudaMemAdvise(
            ptr, size, _ADVISE_SET_PREFERRED_LOCATION, _MemLocation(_LOCATION_HOST, 0)
        )
        mapped = lib.cudaMemAdvise(
            ptr, size, _ADVISE_SET_ACCESSED_BY, _MemLocation(_LOCATION_DEVICE, device)
        )
    except (AttributeError, ctypes.ArgumentError) as e:
        log.debug("cudaMemAdvise unavailable: %s", e)
        return False
    if host or mapped:
        log.debug("cudaMemAdvise refused: %s, %s", host, mapped)
    return bool(host == 0 and mapped == 0)
