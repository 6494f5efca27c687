"""I/O side of the engine: the ring memory and the direct-I/O read backend."""

from smoe.io.direct import BufferedIOWarning, DirectReader, VaultReadError, open_direct
from smoe.io.ring import Ring, mx_dtype

__all__ = [
    "BufferedIOWarning",
    "DirectReader",
    "Ring",
    "VaultReadError",
    "mx_dtype",
    "open_direct",
]
