"""manifest.json: the model of what a vault holds, its validation, and its signature.

``Manifest.from_json`` validates every field of an untrusted manifest (types, ranges, the
record layout against the experts' module and quantization, layers, checksums, the backbone
and config entries) and raises VaultError naming the field and the fix; ``to_json`` writes
one, signed by ``sign_manifest`` so that an edit no validation can see is refused when
``check_signature`` runs on open. The rules are listed in docs/vault-format.md. This module
imports no MLX.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smoe.errors import VaultError
from smoe.models.topology import Topology
from smoe.vault.checks import DIM_MAX, Check, show
from smoe.vault.integrity import CHECKSUM_BITS, DEFAULT_ALGORITHM, HASHES, digest
from smoe.vault.layout import RecordLayout
from smoe.vault.names import BACKBONE_FILE, CONFIG_FILE, EXPERTS_FILE, MANIFEST, STATS_DIR
from smoe.vault.packing import FLOAT_DTYPES, PROJECTIONS, Packing, projection_packing, quant_entry
from smoe.vault.shard import Shard

FORMAT = "smoe-vault"
VERSION = 1

SIGNATURE = "manifest_checksum"


def _canonical(d: dict[str, Any]) -> bytes:
    """The manifest's bytes as signed: every key but the signature, sorted, compact."""
    rest = {k: v for k, v in d.items() if k != SIGNATURE}
    return json.dumps(rest, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def sign_manifest(d: dict[str, Any], algorithm: str = DEFAULT_ALGORITHM) -> dict[str, Any]:
    """``d`` with its signature: a checksum of everything else in it, so that an edit a
    validation cannot see (two like components' names swapped) is refused. Tools that
    edit a manifest on purpose sign it again with this."""
    return {**d, SIGNATURE: {"algorithm": algorithm, "value": digest(algorithm, _canonical(d))}}


def check_signature(raw: dict[str, Any], where: Path) -> None:
    """VaultError unless ``raw`` matches its signature. Vaults made before signatures have
    none: they are validated field by field only."""
    if SIGNATURE not in raw:
        return
    entry = raw[SIGNATURE]
    fix = "the manifest was edited or damaged: convert the model again"
    if not (
        isinstance(entry, dict)
        and entry.get("algorithm") in HASHES
        and type(entry.get("value")) is int
    ):
        raise VaultError(f"{where}: {SIGNATURE} must be {{algorithm, value}}; {fix}")
    try:
        signed = _canonical(raw)
    except (ValueError, TypeError):  # e.g. 1e400 parsed as infinity: not what was signed
        raise VaultError(f"{where} does not match its {SIGNATURE}: {fix}") from None
    if digest(entry["algorithm"], signed) != entry["value"]:
        raise VaultError(f"{where} does not match its {SIGNATURE}: {fix}")


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
    # New vaults use xxh3_64; vaults made before it keep "crc32" in their manifest.
    checksum_algorithm: str = DEFAULT_ALGORITHM
    format: str = FORMAT
    version: int = VERSION
    # config.json's {"file", "checksum"}; empty in vaults made before it was recorded.
    config: dict[str, Any] = field(default_factory=dict)
    # A shard (smoe/vault/shard.py) holds only one rank's expert records; None: all of them.
    shard: Shard | None = None

    @functools.cached_property
    def shape(self) -> Topology:
        """``topology`` typed (validated when the manifest was read): model_type,
        experts_per_token, vocab_size, ... as attributes."""
        optional = dict.fromkeys(_OPTIONAL_TOPOLOGY) | {"tie_word_embeddings": False}
        return Topology.from_json(optional | self.topology)

    @property
    def num_records(self) -> int:
        if self.shard is not None:
            return len(self.shard.keys)
        return len(self.layers) * self.num_experts

    @property
    def experts_bytes(self) -> int:
        return self.num_records * self.record.stride

    def record_index(self, layer: int, expert: int) -> int:
        """Records are layer-major: all experts of the first MoE layer, then the next (of a
        shard: those it holds). IndexError for an expert this vault does not hold."""
        if not 0 <= expert < self.num_experts:
            raise IndexError(f"expert {expert} out of range 0..{self.num_experts - 1}")
        if self.shard is not None:
            index = self.shard.index.get((layer, expert))
            if index is None:
                raise IndexError(
                    f"expert {expert} of layer {layer} is not in this shard (rank "
                    f"{self.shard.rank} of {self.shard.ranks})"
                )
            return index
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
        if self.shard is not None:
            return self.shard.keys[index]
        return self.layers[index // self.num_experts].layer, index % self.num_experts

    def identity(self) -> int:
        """A 63-bit checksum of the full vault's manifest (the one a shard was cut from):
        ranks compare it to check that they run the same model."""
        if self.shard is not None:
            return self.shard.base
        d = {k: v for k, v in self.to_json().items() if k != SIGNATURE}
        return digest(DEFAULT_ALGORITHM, _canonical(d)) & 0x7FFF_FFFF_FFFF_FFFF

    def to_json(self) -> dict[str, Any]:
        """The manifest as written, signed (``sign_manifest``)."""
        d = {
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
            **({"config": self.config} if self.config else {}),
            **({"shard": self.shard.to_json()} if self.shard is not None else {}),
        }
        return sign_manifest(d)

    @classmethod
    def from_json(cls, d: Any, where: str = MANIFEST) -> Manifest:
        """Parse manifest.json's object and validate all of it (docs/vault-format.md,
        "Validation"): types, ranges, the record layout against the experts' module and
        quantization, layers, checksums, the backbone and config entries. Raises VaultError
        naming ``where`` (the file), the field and the fix."""
        # A shard's fix is to cut it again from the full vault, not to convert.
        sharded = isinstance(d, dict) and "shard" in d
        c = Check(where, "cut the shard again with 'smoe shard'") if sharded else Check(where)
        d = c.obj(d, "the manifest")
        if c.key(d, "format", "") != FORMAT:
            raise VaultError(f"{where} is not an S-MoE vault manifest")
        version = c.key(d, "version", "")
        if type(version) is not int:
            c.fail("version", f"must be an integer, not {show(version)}")
        if version != VERSION:
            raise VaultError(
                f"{where} is vault format version {version}, this S-MoE reads "
                f"version {VERSION}: convert the model again with this version"
            )
        topology = _topology(c, c.key(d, "topology", ""))
        quantization = _quantization(c, c.key(d, "quantization", ""))
        record = RecordLayout.from_json(c.key(d, "record", ""), c)
        experts = c.key(d, "experts", "")
        num_experts, layers = _experts(c, experts, topology)
        shard = None
        if "shard" in d:
            ids = tuple(s.layer for s in layers)
            shard = Shard.from_json(c, d["shard"], ids, num_experts)
        count = len(layers) * num_experts if shard is None else len(shard.keys)
        _check_count(c, experts, count, record, len(layers), num_experts)
        algorithm, checksums = _checksums(c, c.key(d, "checksums", ""), count)
        backbone = _file_entry(c, c.key(d, "backbone", ""), "backbone", BACKBONE_FILE)
        config = _file_entry(c, d["config"], "config", CONFIG_FILE) if "config" in d else {}
        projection_packing(c, record, topology, quantization)
        return cls(
            topology=topology,
            record=record,
            layers=layers,
            num_experts=num_experts,
            checksums=checksums,
            checksum_algorithm=algorithm,
            quantization=quantization,
            source=_source_entry(c, c.key(d, "source", "")),
            backbone=backbone,
            created=c.str_(c.key(d, "created", ""), "created", max_len=256),
            producer=c.str_(c.key(d, "producer", ""), "producer", max_len=256),
            format=FORMAT,
            version=version,
            config=config,
            shard=shard,
        )

    def projections(self) -> dict[str, Packing | None]:
        """Each expert projection's quantization as the records hold it: (bits, group_size,
        mode), or None for float weights (validated when the manifest was read)."""
        return projection_packing(Check(MANIFEST), self.record, self.topology, self.quantization)


# A model type or a module path: ASCII names (int() and getattr() accept more than they should).
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+){0,31}")
_LAYER_IN_PATH = re.compile(r"(?:^|\.)layers\.([0-9]+)\.")


# Topology fields a manifest may leave out (older vaults, models without them).
_OPTIONAL_TOPOLOGY = (
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)


def _topology(c: Check, value: Any) -> dict[str, Any]:
    """manifest.json's "topology", every field the engine, ring plan and inspect read."""
    t = c.obj(value, "topology")

    def need(key: str) -> Any:
        return c.key(t, key, "topology")

    c.str_(need("model_type"), "topology.model_type", pattern=_NAME)
    layers = c.int_(need("num_layers"), "topology.num_layers", 1, DIM_MAX)
    for key in ("hidden_size", "vocab_size", "expert_hidden_size"):
        c.int_(need(key), f"topology.{key}", 1, DIM_MAX)
    n = c.int_(need("num_experts"), "topology.num_experts", 1, DIM_MAX)
    c.int_(need("experts_per_token"), "topology.experts_per_token", 1, n)
    c.str_(need("expert_kind"), "topology.expert_kind", choices=tuple(PROJECTIONS))
    moe = c.list_(need("moe_layers"), "topology.moe_layers", 1, layers)
    for i, layer in enumerate(moe):
        c.int_(layer, f"topology.moe_layers[{i}]", 0, layers - 1)
    c.int_(need("shared_experts"), "topology.shared_experts", 0, DIM_MAX)
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim"):
        c.opt_int(t.get(key), f"topology.{key}", 1, DIM_MAX)
    c.opt_int(t.get("max_position_embeddings"), "topology.max_position_embeddings", 1)
    if "tie_word_embeddings" in t:
        c.bool_(t["tie_word_embeddings"], "topology.tie_word_embeddings")
    if "extra" in t:
        c.obj(t["extra"], "topology.extra")
    return t


def _quantization(c: Check, value: Any) -> dict[str, Any]:
    q = c.obj(value, "quantization")
    experts = c.key(q, "experts", "quantization")
    if isinstance(experts, dict) and "projections" in experts:
        # Mixed packings (an MLX source): one entry per projection (null: float); the
        # top-level bits and group_size only summarise them (e.g. "4/8").
        per = c.obj(experts["projections"], "quantization.experts.projections")
        for proj, entry in per.items():
            if entry is not None:
                quant_entry(c, entry, f"quantization.experts.projections[{proj!a}]")
        for key in ("bits", "group_size", "mode"):
            if type(experts.get(key)) not in (int, str, type(None)):
                c.fail(
                    f"quantization.experts.{key}",
                    f"must be a number or text, not {show(experts[key])}",
                )
        if "copied_from_source" in experts:
            c.bool_(experts["copied_from_source"], "quantization.experts.copied_from_source")
    elif experts is not None:
        quant_entry(c, experts, "quantization.experts")
    if q.get("backbone") is not None:
        quant_entry(c, q["backbone"], "quantization.backbone")
        if "modules" in q["backbone"]:
            c.int_(q["backbone"]["modules"], "quantization.backbone.modules")
    if q.get("float_dtype") is not None:
        c.str_(q["float_dtype"], "quantization.float_dtype", choices=FLOAT_DTYPES)
    return q


def _experts(c: Check, value: Any, topology: dict[str, Any]) -> tuple[int, tuple[ExpertLayer, ...]]:
    """manifest.json's "experts": the expert count, and the MoE layers in record order."""
    e = c.obj(value, "experts")
    if "file" in e:
        c.str_(e["file"], "experts.file", choices=(EXPERTS_FILE,))
    n = c.int_(c.key(e, "num_experts", "experts"), "experts.num_experts", 1, DIM_MAX)
    if n != topology["num_experts"]:
        c.fail("experts.num_experts", f"is {n}, topology.num_experts is {topology['num_experts']}")
    num_layers = topology["num_layers"]
    items = c.list_(c.key(e, "layers", "experts"), "experts.layers", 1, num_layers)
    layers: list[ExpertLayer] = []
    template = None
    for i, item in enumerate(items):
        at = f"experts.layers[{i}]"
        item = c.obj(item, at)
        layer = c.int_(c.key(item, "layer", at), f"{at}.layer", 0, num_layers - 1)
        if layers and layer <= layers[-1].layer:
            c.fail(
                f"{at}.layer",
                f"is {layer} after {layers[-1].layer}: layers are listed once, in order",
            )
        module = c.str_(c.key(item, "module", at), f"{at}.module", pattern=_MODULE)
        if _LAYER_IN_PATH.findall(module + ".") != [str(layer)]:
            c.fail(f"{at}.module", f"is {show(module)}, not a module of decoder layer {layer}")
        # v1: one expert module per layer, at the same place in every layer.
        shape = _LAYER_IN_PATH.sub(lambda m: m.group(0).replace(m.group(1), "*"), module + ".")
        if template is not None and shape != template:
            c.fail(f"{at}.module", f"is {show(module)}, unlike experts.layers[0].module")
        template = shape
        layers.append(ExpertLayer(layer, module))
    if topology["moe_layers"] != [s.layer for s in layers]:
        c.fail(
            "topology.moe_layers",
            f"does not list the layers of experts.layers ({[s.layer for s in layers]})",
        )
    return n, tuple(layers)


def _check_count(
    c: Check, value: Any, count: int, record: RecordLayout, layers: int, n: int
) -> None:
    """ "experts.count" and "bytes" (optional) against the records the vault holds."""
    e = c.obj(value, "experts")
    if "count" in e and c.int_(e["count"], "experts.count") != count:
        held = f"{layers} layers of {n} experts are" if count == layers * n else "the shard holds"
        c.fail("experts.count", f"is {e['count']}, but {held} {count}")
    if "bytes" in e and c.int_(e["bytes"], "experts.bytes") != count * record.stride:
        c.fail(
            "experts.bytes",
            f"is {e['bytes']}, but {count} records of {record.stride} bytes are {count * record.stride}",
        )
    if "order" in e:
        c.str_(e["order"], "experts.order", choices=("layer-major",))


def _checksum_range(c: Check, algorithm: Any, name: str) -> tuple[str, int]:
    algorithm = c.str_(algorithm, name, choices=tuple(HASHES))
    return algorithm, (1 << CHECKSUM_BITS.get(algorithm, 64)) - 1


def _checksums(c: Check, value: Any, count: int) -> tuple[str, list[int]]:
    """manifest.json's "checksums": the algorithm, and one value per record."""
    ch = c.obj(value, "checksums")
    algorithm, top = _checksum_range(c, c.key(ch, "algorithm", "checksums"), "checksums.algorithm")
    values = c.list_(c.key(ch, "values", "checksums"), "checksums.values")
    if len(values) != count:
        c.fail("checksums.values", f"has {len(values)} checksums for {count} records")
    for i, v in enumerate(values):
        if type(v) is not int or not 0 <= v <= top:
            c.int_(v, f"checksums.values[{i}]", 0, top)
    return algorithm, values


# Names a copied side file may not take: the vault's own files, and the export's weights.
_NOT_SIDE_FILES = {
    MANIFEST,
    EXPERTS_FILE,
    BACKBONE_FILE,
    CONFIG_FILE,
    STATS_DIR,
    "model.safetensors",
}
MAX_SIDE_FILES = 4096


def _source_entry(c: Check, value: Any) -> dict[str, Any]:
    """The "source" entry. "copied" lists the side files (tokenizer, templates) copied from
    the source: plain names of files beside the manifest, each once, none of the vault's
    own; "export" copies them, the tokenizer reads them, so a path ("../x", "/home/...")
    there would read or copy a file from anywhere. "checksums" (vaults made since they are
    recorded) maps each of them, and only them, to {"algorithm", "value"}. The checksum
    covers the bytes, not the name: whoever hands out a vault can sign any manifest."""
    e = c.obj(value, "source")
    copied = e.get("copied")
    if copied is not None:
        for i, name in enumerate(c.list_(copied, "source.copied", 0, MAX_SIDE_FILES)):
            at = f"source.copied[{i}]"
            if not isinstance(name, str) or not _plain_name(name) or name in _NOT_SIDE_FILES:
                c.fail(at, f"is {show(name)}, not the name of a file the vault copied")
            c.str_(name, at, max_len=255)
        if len(set(copied)) != len(copied):
            c.fail("source.copied", "lists a file twice")
    if "checksums" in e:
        sums = c.obj(e["checksums"], "source.checksums")
        for name, ch in sums.items():
            where = f"source.checksums[{name!a}]"
            if not isinstance(copied, list) or name not in copied:
                c.fail(where, "names a file the vault did not copy")
            c.obj(ch, where)
            _, top = _checksum_range(c, c.key(ch, "algorithm", where), f"{where}.algorithm")
            c.int_(c.key(ch, "value", where), f"{where}.value", 0, top)
        for name in copied or []:
            if name not in sums:  # it would be exported and read unchecked
                c.fail(f"source.copied ({show(name)})", "names a file without a checksum")
    return e


def _plain_name(name: str) -> bool:
    """A file name, not a path: no separator, not "." or "..", no NUL."""
    return name not in ("", ".", "..") and not any(ch in name for ch in "/\\\0")


def _file_entry(c: Check, value: Any, name: str, file: str) -> dict[str, Any]:
    """The "backbone" or "config" entry: {"file", "bytes", "tensors", "checksum"}."""
    e = c.obj(value, name)
    if "file" in e:
        c.str_(e["file"], f"{name}.file", choices=(file,))
    if name == "backbone":
        c.int_(c.key(e, "bytes", name), f"{name}.bytes")
    if "tensors" in e:
        c.int_(e["tensors"], f"{name}.tensors")
    # The config entry exists only to carry the checksum.
    if "checksum" in e or name == "config":
        ch = c.obj(c.key(e, "checksum", name), f"{name}.checksum")
        _, top = _checksum_range(
            c, c.key(ch, "algorithm", f"{name}.checksum"), f"{name}.checksum.algorithm"
        )
        c.int_(c.key(ch, "value", f"{name}.checksum"), f"{name}.checksum.value", 0, top)
    return e
