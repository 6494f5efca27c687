"""A downloaded shard's safetensors header, read as untrusted input.

``read_header`` parses the 8-byte length and the JSON header of one ``*.safetensors`` file
and validates everything the source index relies on before any tensor is read: the
header length within bounds and the file, strict JSON holding an object, each tensor's
dtype known, its shape of non-negative integers, its byte range the size its dtype and
shape imply, inside the file and overlapping no other tensor. A bad file is a
CheckpointError (one line) naming the file, the tensor and the fix. No MLX import.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smoe.errors import CheckpointError
from smoe.util.files import NotRegularFile, open_regular

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
REDOWNLOAD = "download the file again"

# safetensors dtype -> (our dtype name, bytes per element). Names are the vault's
# (smoe.vault.layout.ITEMSIZE) where a record can hold them; the others (float64, 8-bit
# floats) may sit in the backbone, which mlx-lm loads itself.
DTYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "U16": ("uint16", 2),
    "I16": ("int16", 2),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "U32": ("uint32", 4),
    "I32": ("int32", 4),
    "F32": ("float32", 4),
    "U64": ("uint64", 8),
    "I64": ("int64", 8),
    "F64": ("float64", 8),
    "F8_E4M3": ("float8_e4m3", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a shard: its dtype (our name), shape, and absolute byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # byte offset in the file (header included)
    nbytes: int

    @property
    def end(self) -> int:
        return self.start + self.nbytes


@dataclass(frozen=True)
class ShardHeader:
    """A validated shard: its path, size and tensors by name."""

    path: Path
    size: int
    tensors: dict[str, TensorEntry]


def _bad(path: Path, problem: str, fix: str = REDOWNLOAD) -> CheckpointError:
    return CheckpointError(f"{path}: {problem}; {fix}")


def _entry(path: Path, name: str, value: Any, data_start: int, size: int) -> TensorEntry:
    """One header entry, validated: a known dtype, a shape, offsets matching them, in the file."""
    label = f"tensor {name[:120]!a}"
    if not isinstance(value, dict):
        raise _bad(path, f"{label} is not described by an object in the header")
    dtype = value.get("dtype")
    if dtype not in DTYPES:
        raise _bad(path, f"{label} has unknown dtype {str(dtype)[:20]!a}")
    shape = value.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise _bad(path, f"{label} has a shape that is not a list of sizes")
    offsets = value.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise _bad(path, f"{label} has data_offsets that are not [begin, end]")
    name_dtype, item = DTYPES[dtype]
    want = math.prod(shape) * item
    if offsets[1] - offsets[0] != want:
        raise _bad(
            path,
            f"{label} spans {offsets[1] - offsets[0]} bytes, but {dtype}{shape} is {want}",
        )
    if data_start + offsets[1] > size:
        raise _bad(
            path,
            f"{label} ends at byte {data_start + offsets[1]}, past the end of the file "
            f"({size} bytes): the file is truncated",
        )
    return TensorEntry(path, name_dtype, tuple(shape), data_start + offsets[0], want)


def read_header(path: Path) -> ShardHeader:
    """Parse and validate ``path``'s safetensors header (see the module docstring).
    Raises CheckpointError naming the file and the fix; never reads tensor data."""
    try:
        with open_regular(path) as f:  # a FIFO would block the read forever
            size = f.seek(0, 2)
            f.seek(0)
            head = f.read(8)
            if len(head) < 8:
                raise _bad(path, "is empty or cut short (no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n < 2 or n > MAX_HEADER_BYTES or n > size - 8:
                raise _bad(
                    path,
                    f"declares a header of {n} bytes in a file of {size}: truncated, or not "
                    "a safetensors file",
                )
            raw = f.read(n)
    except NotRegularFile as e:
        raise _bad(path, f"is {e.kind}, not a regular file", REDOWNLOAD) from None
    except OSError as e:
        raise _bad(path, f"cannot be read ({e.strerror})", "check the file's permissions") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _bad(path, "has a corrupt header (not JSON)") from None
    if not isinstance(header, dict):
        raise _bad(path, "has a header that is not a JSON object")
    data_start = 8 + n
    tensors = {
        name: _entry(path, name, value, data_start, size)
        for name, value in header.items()
        if name != "__metadata__"
    }
    _check_disjoint(path, tensors)
    return ShardHeader(path, size, tensors)


def _check_disjoint(path: Path, tensors: dict[str, TensorEntry]) -> None:
    """No two tensors share a byte (an edited or forged header could alias them)."""
    spans = sorted((t.start, t.end, name) for name, t in tensors.items() if t.nbytes)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise _bad(path, f"tensors {a[:80]!a} and {b[:80]!a} overlap in the file")
