"""Streaming safetensors writer: one tensor in memory at a time.

``mx.save_safetensors`` needs every tensor evaluated at once; a 235B backbone does not
fit a laptop that way. The header only needs shapes and dtypes, which lazy arrays know.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

SAFETENSORS_DTYPE = {
    mx.bool_: "BOOL",
    mx.uint8: "U8",
    mx.int8: "I8",
    mx.uint16: "U16",
    mx.int16: "I16",
    mx.uint32: "U32",
    mx.int32: "I32",
    mx.uint64: "U64",
    mx.int64: "I64",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.float32: "F32",
}


def dtype_name(dtype: mx.Dtype) -> str:
    """'bfloat16' for mx.bfloat16: the spelling the vault manifest uses."""
    return str(dtype).rsplit(".", 1)[-1]


def array_bytes(a: mx.array) -> np.ndarray:
    """An evaluated array's bytes as a flat uint8 numpy view (bf16-safe, C order)."""
    a = mx.contiguous(a)
    mx.eval(a)
    flat = a.reshape(-1)
    if flat.dtype == mx.bool_:
        flat = flat.astype(mx.uint8)
    return np.asarray(flat.view(mx.uint8)) if flat.size else np.zeros(0, np.uint8)


def write_safetensors(path: Path, tensors: dict[str, mx.array], metadata: dict[str, str]) -> int:
    """Write ``tensors`` (lazy is fine) to ``path``, evaluating and dropping one at a time.

    Empties ``tensors`` as it goes so that written tensors can be freed. Returns the
    file size. The file is fsynced before returning.
    """
    header: dict[str, Any] = {}
    offset = 0
    for name, a in tensors.items():
        nbytes = a.size * a.dtype.size
        header[name] = {
            "dtype": SAFETENSORS_DTYPE[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in list(tensors):
            data = array_bytes(tensors.pop(name))
            f.write(memoryview(data))
            del data
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(blob) + offset
