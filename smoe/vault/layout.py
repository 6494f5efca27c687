"""The byte layout of an expert record in experts.bin: its components, size and stride.

Every record of a vault shares one layout: each component (one tensor of an expert, e.g.
'gate_proj.scales') at a COMPONENT_ALIGN-aligned offset after the previous one, the record
padded with zeros to a multiple of RECORD_ALIGN, so one direct read fills one ring slot.
``RecordLayout.build`` makes the layout a converter writes; ``RecordLayout.from_json``
validates the one a manifest states. This module imports no MLX.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from smoe.vault.checks import DIM_MAX, Check, show
from smoe.vault.names import MANIFEST

RECORD_ALIGN = 16 * 1024  # every record starts here: one direct read fills one slot
COMPONENT_ALIGN = 256  # every component starts here inside its record

ITEMSIZE = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "uint16": 2,
    "int16": 2,
    "float16": 2,
    "bfloat16": 2,
    "uint32": 4,
    "int32": 4,
    "float32": 4,
    "uint64": 8,
    "int64": 8,
}


def align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


@dataclass(frozen=True)
class Component:
    """One tensor of an expert inside a record, e.g. 'gate_proj.scales'."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # bytes from the record's start

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
        }


@dataclass(frozen=True)
class RecordLayout:
    """The byte layout shared by every record: components, record size and stride."""

    components: tuple[Component, ...]
    size: int  # bytes that carry data (the checksum covers these)
    stride: int  # bytes from one record to the next: size rounded up to RECORD_ALIGN

    @classmethod
    def build(cls, specs: list[tuple[str, str, tuple[int, ...]]]) -> RecordLayout:
        """Place (name, dtype, shape) components one after another, each aligned."""
        offset = 0
        components = []
        for name, dtype, shape in specs:
            if dtype not in ITEMSIZE:
                raise ValueError(f"unsupported component dtype {dtype}")
            offset = align_up(offset, COMPONENT_ALIGN)
            c = Component(name, dtype, tuple(int(s) for s in shape), offset)
            components.append(c)
            offset += c.nbytes
        return cls(tuple(components), offset, align_up(offset, RECORD_ALIGN))

    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "stride": self.stride,
            "alignment": RECORD_ALIGN,
            "components": [c.to_json() for c in self.components],
        }

    def padding(self) -> list[tuple[int, int]]:
        """The [start, end) byte ranges of a record that no component covers (zero on disk):
        the gaps that align each component, and ``size`` to ``stride``."""
        gaps, end = [], 0
        for c in sorted(self.components, key=lambda c: c.offset):
            if c.offset > end:
                gaps.append((end, c.offset))
            end = max(end, c.offset + c.nbytes)
        if self.stride > end:
            gaps.append((end, self.stride))
        return gaps

    @classmethod
    def from_json(cls, d: Any, check: Check | None = None) -> RecordLayout:
        """Parse and validate manifest.json's "record": each component where the format puts
        it (after the previous one, at the next multiple of COMPONENT_ALIGN), ``size`` where
        the last ends, ``stride`` that rounded up to RECORD_ALIGN. Raises VaultError."""
        c = check or Check(MANIFEST)
        d = c.obj(d, "record")
        items = c.list_(c.key(d, "components", "record"), "record.components", 1, 4096)
        comps: list[Component] = []
        names: set[str] = set()
        end = 0
        for i, item in enumerate(items):
            comp = _component_from_json(c, item, f"record.components[{i}]", names, end)
            comps.append(comp)
            end = comp.offset + comp.nbytes
        size = c.int_(c.key(d, "size", "record"), "record.size", 1)
        if size != end:
            c.fail("record.size", f"is {size}, but the components end at byte {end}")
        stride = c.int_(c.key(d, "stride", "record"), "record.stride", 1)
        if stride != align_up(size, RECORD_ALIGN):
            c.fail(
                "record.stride",
                f"is {stride}, not the size {size} rounded up to {RECORD_ALIGN}: "
                f"{align_up(size, RECORD_ALIGN)}",
            )
        if "alignment" in d and c.int_(d["alignment"], "record.alignment") != RECORD_ALIGN:
            c.fail("record.alignment", f"is {d['alignment']}; vault v1 aligns to {RECORD_ALIGN}")
        return cls(tuple(comps), size, stride)


def _component_from_json(c: Check, item: Any, at: str, names: set[str], end: int) -> Component:
    """One entry of "record.components", validated: a name not in ``names`` (added to it),
    a known dtype, a shape MLX can hold, and the offset the format gives a component after
    one that ends at byte ``end``."""
    item = c.obj(item, at)
    name = c.str_(c.key(item, "name", at), f"{at}.name", max_len=256)
    if name in names:
        c.fail(f"{at}.name", f"repeats {show(name)}")
    names.add(name)
    dtype = c.str_(c.key(item, "dtype", at), f"{at}.dtype", choices=tuple(ITEMSIZE))
    dims = c.list_(c.key(item, "shape", at), f"{at}.shape", 0, 8)
    shape = tuple(c.int_(n, f"{at}.shape[{j}]", 1, DIM_MAX) for j, n in enumerate(dims))
    offset = c.int_(c.key(item, "offset", at), f"{at}.offset")
    comp = Component(name, dtype, shape, offset)
    if "nbytes" in item and c.int_(item["nbytes"], f"{at}.nbytes") != comp.nbytes:
        c.fail(
            f"{at}.nbytes",
            f"is {item['nbytes']}, but {dtype}{list(shape)} is {comp.nbytes}",
        )
    want = align_up(end, COMPONENT_ALIGN)
    if offset != want:
        c.fail(
            f"{at}.offset",
            f"is {offset}; the format puts {show(name)} at {want} (after the previous "
            f"component, at the next multiple of {COMPONENT_ALIGN} bytes)",
        )
    return comp
