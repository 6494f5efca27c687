"""Vault format v1: the manifest, the record layout, and opening a vault for reading.

A vault is a directory (docs/vault-format.md):
    manifest.json          written last: a directory without it is not a vault
    experts.bin            one record per (MoE layer, expert), each at a 16 KiB-aligned offset
    backbone.safetensors   every non-expert weight, mlx-lm naming
    config.json            the mlx-lm-ready config (with its "quantization" entry)
    tokenizer files, generation_config.json, source_config.json
    stats/                 per-vault statistics kept by the engine
This module imports no MLX: the I/O side and the scheduler read vaults too.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smoe.errors import VaultError

FORMAT = "smoe-vault"
VERSION = 1
RECORD_ALIGN = 16 * 1024  # every record starts here: one direct read fills one slot
COMPONENT_ALIGN = 256  # every component starts here inside its record
MANIFEST = "manifest.json"
EXPERTS_FILE = "experts.bin"
BACKBONE_FILE = "backbone.safetensors"
CONFIG_FILE = "config.json"
STATS_DIR = "stats"

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

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RecordLayout:
        comps = tuple(
            Component(c["name"], c["dtype"], tuple(c["shape"]), int(c["offset"]))
            for c in d["components"]
        )
        return cls(comps, int(d["size"]), int(d["stride"]))


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer's experts: decoder layer index and mlx-lm module path."""

    layer: int
    module: str  # e.g. "model.layers.3.mlp.switch_mlp"


@dataclass
class Manifest:
    """Everything manifest.json holds; see docs/vault-format.md."""

    topology: dict[str, Any]
    record: RecordLayout
    layers: tuple[ExpertLayer, ...]
    num_experts: int
    checksums: list[int]
    quantization: dict[str, Any]
    source: dict[str, Any]
    backbone: dict[str, Any]
    created: str
    producer: str
    checksum_algorithm: str = "crc32"
    format: str = FORMAT
    version: int = VERSION

    @property
    def num_records(self) -> int:
        return len(self.layers) * self.num_experts

    @property
    def experts_bytes(self) -> int:
        return self.num_records * self.record.stride

    def record_index(self, layer: int, expert: int) -> int:
        """Records are layer-major: all experts of the first MoE layer, then the next."""
        if not 0 <= expert < self.num_experts:
            raise IndexError(f"expert {expert} out of range 0..{self.num_experts - 1}")
        return self.layer_position(layer) * self.num_experts + expert

    def layer_position(self, layer: int) -> int:
        for i, spec in enumerate(self.layers):
            if spec.layer == layer:
                return i
        raise IndexError(f"layer {layer} has no routed experts")

    def record_offset(self, layer: int, expert: int) -> int:
        return self.record_index(layer, expert) * self.record.stride

    def record_key(self, index: int) -> tuple[int, int]:
        """(decoder layer, expert) of a record index."""
        return self.layers[index // self.num_experts].layer, index % self.num_experts

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "version": self.version,
            "producer": self.producer,
            "created": self.created,
            "source": self.source,
            "topology": self.topology,
            "quantization": self.quantization,
            "record": self.record.to_json(),
            "experts": {
                "file": EXPERTS_FILE,
                "num_experts": self.num_experts,
                "layers": [{"layer": s.layer, "module": s.module} for s in self.layers],
                "count": self.num_records,
                "bytes": self.experts_bytes,
                "order": "layer-major",
            },
            "checksums": {"algorithm": self.checksum_algorithm, "values": self.checksums},
            "backbone": self.backbone,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Manifest:
        experts = d["experts"]
        return cls(
            topology=d["topology"],
            record=RecordLayout.from_json(d["record"]),
            layers=tuple(ExpertLayer(int(s["layer"]), s["module"]) for s in experts["layers"]),
            num_experts=int(experts["num_experts"]),
            checksums=[int(c) for c in d["checksums"]["values"]],
            checksum_algorithm=d["checksums"]["algorithm"],
            quantization=d["quantization"],
            source=d["source"],
            backbone=d["backbone"],
            created=d["created"],
            producer=d["producer"],
            format=d["format"],
            version=int(d["version"]),
        )


class Vault:
    """An opened vault: its manifest and paths, checked for completeness.

    Opening reads only manifest.json and stats the other files; it never reads records.
    Raises VaultError naming the file when the directory is not a complete v1 vault.
    """

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest

    @property
    def experts_path(self) -> Path:
        return self.path / EXPERTS_FILE

    @property
    def backbone_path(self) -> Path:
        return self.path / BACKBONE_FILE

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def stats_dir(self) -> Path:
        return self.path / STATS_DIR

    def config(self) -> dict[str, Any]:
        with open(self.config_path) as f:
            data: dict[str, Any] = json.load(f)
        return data

    @classmethod
    def open(cls, path: Path | str) -> Vault:
        path = Path(path)
        if not path.is_dir():
            raise VaultError(f"{path} is not a directory; give a vault made by 'smoe convert'")
        mpath = path / MANIFEST
        if not mpath.exists():
            raise VaultError(
                f"{path} is not a vault ({MANIFEST} is missing; an interrupted conversion "
                "leaves none): run 'smoe convert' again"
            )
        try:
            raw = json.loads(mpath.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise VaultError(f"{mpath} is unreadable ({e}); convert the model again") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise VaultError(f"{mpath} is not an S-MoE vault manifest")
        if raw.get("version") != VERSION:
            raise VaultError(
                f"{mpath} is vault format version {raw.get('version')}, this S-MoE reads "
                f"version {VERSION}: convert the model again with this version"
            )
        try:
            manifest = Manifest.from_json(raw)
        except (KeyError, TypeError, ValueError) as e:
            raise VaultError(
                f"{mpath} is incomplete (missing {e}); convert the model again"
            ) from None
        vault = cls(path, manifest)
        for f in (vault.backbone_path, vault.config_path, vault.experts_path):
            if not f.exists():
                raise VaultError(
                    f"{f} is missing; the vault is incomplete: convert the model again"
                )
        size = vault.experts_path.stat().st_size
        if size != manifest.experts_bytes:
            raise VaultError(
                f"{vault.experts_path} has {size} bytes, the manifest says "
                f"{manifest.experts_bytes}: the vault is truncated or altered; convert again"
            )
        if len(manifest.checksums) != manifest.num_records:
            raise VaultError(
                f"{mpath} has {len(manifest.checksums)} checksums for "
                f"{manifest.num_records} records; convert the model again"
            )
        return vault
