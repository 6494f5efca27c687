"""Vault format v1: the manifest, the record layout, and opening a vault for reading.

A vault is a directory (docs/vault-format.md):
    manifest.json          written last: a directory without it is not a vault
    experts.bin            one record per (MoE layer, expert), each at a 16 KiB-aligned offset
    backbone.safetensors   every non-expert weight, mlx-lm naming
    config.json            the mlx-lm-ready config (with its "quantization" entry)
    tokenizer files, generation_config.json, source_config.json
    stats/                 per-vault statistics kept by the engine
This module imports no MLX: the I/O side and the scheduler read vaults too.

Everything a vault holds is untrusted input: opening one validates manifest.json and
config.json completely (``Manifest.from_json``, ``Vault.config``) before anything is mapped or
read, so a damaged or edited vault is a VaultError naming the field and the fix, never a
crash, a traceback or silently wrong output. The rules are listed in docs/vault-format.md.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import mmap
import os
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from smoe.errors import VaultError
from smoe.models.topology import _EXPERT_COUNT_KEYS, _TOP_K_KEYS, Topology
from smoe.util.files import recover_dir, write_json_atomic
from smoe.vault.integrity import DEFAULT_ALGORITHM, HASHES, digest

FORMAT = "smoe-vault"
VERSION = 1
RECORD_ALIGN = 16 * 1024  # every record starts here: one direct read fills one slot
COMPONENT_ALIGN = 256  # every component starts here inside its record
MANIFEST = "manifest.json"
EXPERTS_FILE = "experts.bin"
BACKBONE_FILE = "backbone.safetensors"
CONFIG_FILE = "config.json"
STATS_DIR = "stats"
BACKBONE_MEMO = "backbone-verified.json"  # in stats/: the file state last hashed and found good

MAX_MANIFEST_BYTES = 64 << 20  # a million records' checksums take ~20 MB
MAX_CONFIG_BYTES = 16 << 20
QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
# The parameters of mlx-lm's expert modules: a component is '<projection>.<part>'.
PROJECTIONS = {"SwitchGLU": ("gate_proj", "up_proj", "down_proj"), "SwitchMLP": ("fc1", "fc2")}
PARTS = ("weight", "scales", "biases", "bias", "global_scale")
CHECKSUM_BITS = {"crc32": 32, "xxh3_64": 64}  # width of each algorithm's values
_INT64_MAX = 2**63 - 1  # file offsets and sizes (off_t)
_DIM_MAX = 2**31 - 1  # MLX sizes each dimension with a 32-bit int
_FIX = "convert the model again"

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


def _show(value: Any) -> str:
    """An untrusted value for a one-line message: short, and ASCII (a lone surrogate from
    the JSON cannot be printed)."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    text = ascii(value[:48] if isinstance(value, str) else value)
    return text if len(text) <= 48 else text[:45] + "..."


class _Check:
    """Typed reads of one untrusted JSON document. Each accessor returns the value with the
    type and range asked for, or raises VaultError naming the file, the field and the fix."""

    def __init__(self, where: str, fix: str = _FIX) -> None:
        self.where = where
        self.fix = fix

    def fail(self, name: str, problem: str) -> NoReturn:
        raise VaultError(f"{self.where}: {name} {problem}; {self.fix}")

    def obj(self, value: Any, name: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(name, f"must be a JSON object, not {_show(value)}")
        return value

    def key(self, d: dict[str, Any], key: str, parent: str) -> Any:
        name = f"{parent}.{key}" if parent else key
        if key not in d:
            self.fail(name, "is missing")
        return d[key]

    def int_(self, value: Any, name: str, lo: int = 0, hi: int = _INT64_MAX) -> int:
        # bool is an int subclass and JSON's 1.0 a float: neither is a count or an offset.
        if type(value) is not int or not lo <= value <= hi:
            self.fail(name, f"must be an integer from {lo} to {hi}, not {_show(value)}")
        return value

    def opt_int(self, value: Any, name: str, lo: int = 0, hi: int = _INT64_MAX) -> int | None:
        return None if value is None else self.int_(value, name, lo, hi)

    def bool_(self, value: Any, name: str) -> bool:
        if type(value) is not bool:
            self.fail(name, f"must be true or false, not {_show(value)}")
        return value

    def str_(
        self,
        value: Any,
        name: str,
        choices: tuple[str, ...] | None = None,
        pattern: re.Pattern[str] | None = None,
        max_len: int = 4096,
    ) -> str:
        if not isinstance(value, str) or len(value) > max_len:
            self.fail(name, f"must be a string of at most {max_len} characters, not {_show(value)}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            self.fail(name, f"is not valid Unicode ({_show(value)})")
        if choices is not None and value not in choices:
            self.fail(name, f"must be one of {', '.join(choices)}, not {_show(value)}")
        if pattern is not None and not pattern.fullmatch(value):
            self.fail(name, f"is not a valid value ({_show(value)})")
        return value

    def list_(self, value: Any, name: str, lo: int = 0, hi: int = _INT64_MAX) -> list[Any]:
        if not isinstance(value, list) or not lo <= len(value) <= hi:
            self.fail(name, f"must be a list of {lo} to {hi} items, not {_show(value)}")
        return value


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):  # ambiguous: other JSON readers keep the first, Python the last
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"the key {_show(k)} appears twice in one object")
            seen.add(k)
    return d


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _read_limited(path: Path, limit: int) -> bytes:
    """The bytes of a small vault file, or a VaultError when it is unreadable or too big."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise VaultError(f"{path} is unreadable ({e.strerror}); {_FIX}") from None
    if len(data) > limit:
        raise VaultError(f"{path} is larger than {limit} bytes, too large to be ours; {_FIX}")
    return data


def _parse_json(data: bytes, path: Path) -> Any:
    """Strict JSON: UTF-8, no NaN or Infinity, no key twice in an object, bounded nesting."""
    try:
        return json.loads(
            data.decode("utf-8"),
            object_pairs_hook=_no_duplicate_keys,
            parse_constant=_no_constant,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        reason = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise VaultError(f"{path} is not valid JSON ({reason}); {_FIX}") from None


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


def _check_signature(raw: dict[str, Any], where: Path) -> None:
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


def file_checksum(path: Path | str, algorithm: str = DEFAULT_ALGORITHM) -> dict[str, Any]:
    """``{"algorithm", "value"}``: the manifest's entry for a whole file (the backbone, the
    config). The file is mapped, not read into memory; OSError if it cannot be read."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return {"algorithm": algorithm, "value": digest(algorithm, b"")}
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if hasattr(mm, "madvise"):  # one pass, front to back: read ahead far
                mm.madvise(mmap.MADV_SEQUENTIAL)
            return {"algorithm": algorithm, "value": digest(algorithm, mm)}


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
    def from_json(cls, d: Any, check: _Check | None = None) -> RecordLayout:
        """Parse and validate manifest.json's "record": each component where the format puts
        it (after the previous one, at the next multiple of COMPONENT_ALIGN), ``size`` where
        the last ends, ``stride`` that rounded up to RECORD_ALIGN. Raises VaultError."""
        c = check or _Check(MANIFEST)
        d = c.obj(d, "record")
        items = c.list_(c.key(d, "components", "record"), "record.components", 1, 4096)
        comps: list[Component] = []
        names: set[str] = set()
        end = 0
        for i, item in enumerate(items):
            at = f"record.components[{i}]"
            item = c.obj(item, at)
            name = c.str_(c.key(item, "name", at), f"{at}.name", max_len=256)
            if name in names:
                c.fail(f"{at}.name", f"repeats {_show(name)}")
            names.add(name)
            dtype = c.str_(c.key(item, "dtype", at), f"{at}.dtype", choices=tuple(ITEMSIZE))
            dims = c.list_(c.key(item, "shape", at), f"{at}.shape", 0, 8)
            shape = tuple(c.int_(n, f"{at}.shape[{j}]", 1, _DIM_MAX) for j, n in enumerate(dims))
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
                    f"is {offset}; the format puts {_show(name)} at {want} (after the previous "
                    f"component, at the next multiple of {COMPONENT_ALIGN} bytes)",
                )
            comps.append(comp)
            end = offset + comp.nbytes
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

    @functools.cached_property
    def shape(self) -> Topology:
        """``topology`` typed (validated when the manifest was read): model_type,
        experts_per_token, vocab_size, ... as attributes."""
        optional = dict.fromkeys(_OPTIONAL_TOPOLOGY) | {"tie_word_embeddings": False}
        return Topology.from_json(optional | self.topology)

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
        }
        return sign_manifest(d)

    @classmethod
    def from_json(cls, d: Any, where: str = MANIFEST) -> Manifest:
        """Parse manifest.json's object and validate all of it (docs/vault-format.md,
        "Validation"): types, ranges, the record layout against the experts' module and
        quantization, layers, checksums, the backbone and config entries. Raises VaultError
        naming ``where`` (the file), the field and the fix."""
        c = _Check(where)
        d = c.obj(d, "the manifest")
        if c.key(d, "format", "") != FORMAT:
            raise VaultError(f"{where} is not an S-MoE vault manifest")
        version = c.key(d, "version", "")
        if type(version) is not int:
            c.fail("version", f"must be an integer, not {_show(version)}")
        if version != VERSION:
            raise VaultError(
                f"{where} is vault format version {version}, this S-MoE reads "
                f"version {VERSION}: convert the model again with this version"
            )
        topology = _topology(c, c.key(d, "topology", ""))
        quantization = _quantization(c, c.key(d, "quantization", ""))
        record = RecordLayout.from_json(c.key(d, "record", ""), c)
        num_experts, layers = _experts(c, c.key(d, "experts", ""), topology, record)
        algorithm, checksums = _checksums(c, c.key(d, "checksums", ""), len(layers) * num_experts)
        backbone = _file_entry(c, c.key(d, "backbone", ""), "backbone", BACKBONE_FILE)
        config = _file_entry(c, d["config"], "config", CONFIG_FILE) if "config" in d else {}
        _projections(c, record, topology, quantization)
        return cls(
            topology=topology,
            record=record,
            layers=layers,
            num_experts=num_experts,
            checksums=checksums,
            checksum_algorithm=algorithm,
            quantization=quantization,
            source=c.obj(c.key(d, "source", ""), "source"),
            backbone=backbone,
            created=c.str_(c.key(d, "created", ""), "created", max_len=256),
            producer=c.str_(c.key(d, "producer", ""), "producer", max_len=256),
            format=FORMAT,
            version=version,
            config=config,
        )

    def projections(self) -> dict[str, tuple[int, int, str] | None]:
        """Each expert projection's quantization as the records hold it: (bits, group_size,
        mode), or None for float weights (validated when the manifest was read)."""
        return _projections(_Check(MANIFEST), self.record, self.topology, self.quantization)


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


def _topology(c: _Check, value: Any) -> dict[str, Any]:
    """manifest.json's "topology", every field the engine, ring plan and inspect read."""
    t = c.obj(value, "topology")

    def need(key: str) -> Any:
        return c.key(t, key, "topology")

    c.str_(need("model_type"), "topology.model_type", pattern=_NAME)
    layers = c.int_(need("num_layers"), "topology.num_layers", 1, _DIM_MAX)
    for key in ("hidden_size", "vocab_size", "expert_hidden_size"):
        c.int_(need(key), f"topology.{key}", 1, _DIM_MAX)
    n = c.int_(need("num_experts"), "topology.num_experts", 1, _DIM_MAX)
    c.int_(need("experts_per_token"), "topology.experts_per_token", 1, n)
    c.str_(need("expert_kind"), "topology.expert_kind", choices=tuple(PROJECTIONS))
    moe = c.list_(need("moe_layers"), "topology.moe_layers", 1, layers)
    for i, layer in enumerate(moe):
        c.int_(layer, f"topology.moe_layers[{i}]", 0, layers - 1)
    c.int_(need("shared_experts"), "topology.shared_experts", 0, _DIM_MAX)
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim"):
        c.opt_int(t.get(key), f"topology.{key}", 1, _DIM_MAX)
    c.opt_int(t.get("max_position_embeddings"), "topology.max_position_embeddings", 1)
    if "tie_word_embeddings" in t:
        c.bool_(t["tie_word_embeddings"], "topology.tie_word_embeddings")
    if "extra" in t:
        c.obj(t["extra"], "topology.extra")
    return t


def _quant_entry(c: _Check, value: Any, name: str) -> tuple[int, int, str]:
    """A quantization entry ({"bits", "group_size", "mode"}): (bits, group_size, mode)."""
    e = c.obj(value, name)
    bits = c.key(e, "bits", name)
    if type(bits) is not int or bits not in QUANT_BITS:
        c.fail(
            f"{name}.bits", f"must be one of {', '.join(map(str, QUANT_BITS))}, not {_show(bits)}"
        )
    group = c.int_(c.key(e, "group_size", name), f"{name}.group_size", 1, 1 << 16)
    mode = c.str_(e.get("mode", "affine"), f"{name}.mode", choices=QUANT_MODES)
    if "copied_from_source" in e:
        c.bool_(e["copied_from_source"], f"{name}.copied_from_source")
    return bits, group, mode


def _quantization(c: _Check, value: Any) -> dict[str, Any]:
    q = c.obj(value, "quantization")
    experts = c.key(q, "experts", "quantization")
    if isinstance(experts, dict) and "projections" in experts:
        # Mixed packings (an MLX source): one entry per projection (null: float); the
        # top-level bits and group_size only summarise them (e.g. "4/8").
        per = c.obj(experts["projections"], "quantization.experts.projections")
        for proj, entry in per.items():
            if entry is not None:
                _quant_entry(c, entry, f"quantization.experts.projections[{proj!a}]")
        for key in ("bits", "group_size", "mode"):
            if type(experts.get(key)) not in (int, str, type(None)):
                c.fail(
                    f"quantization.experts.{key}",
                    f"must be a number or text, not {_show(experts[key])}",
                )
        if "copied_from_source" in experts:
            c.bool_(experts["copied_from_source"], "quantization.experts.copied_from_source")
    elif experts is not None:
        _quant_entry(c, experts, "quantization.experts")
    if q.get("backbone") is not None:
        _quant_entry(c, q["backbone"], "quantization.backbone")
        if "modules" in q["backbone"]:
            c.int_(q["backbone"]["modules"], "quantization.backbone.modules")
    if q.get("float_dtype") is not None:
        c.str_(q["float_dtype"], "quantization.float_dtype", choices=FLOAT_DTYPES)
    return q


def _experts(
    c: _Check, value: Any, topology: dict[str, Any], record: RecordLayout
) -> tuple[int, tuple[ExpertLayer, ...]]:
    """manifest.json's "experts": the expert count, and the MoE layers in record order."""
    e = c.obj(value, "experts")
    if "file" in e:
        c.str_(e["file"], "experts.file", choices=(EXPERTS_FILE,))
    n = c.int_(c.key(e, "num_experts", "experts"), "experts.num_experts", 1, _DIM_MAX)
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
            c.fail(f"{at}.module", f"is {_show(module)}, not a module of decoder layer {layer}")
        # v1: one expert module per layer, at the same place in every layer.
        shape = _LAYER_IN_PATH.sub(lambda m: m.group(0).replace(m.group(1), "*"), module + ".")
        if template is not None and shape != template:
            c.fail(f"{at}.module", f"is {_show(module)}, unlike experts.layers[0].module")
        template = shape
        layers.append(ExpertLayer(layer, module))
    if topology["moe_layers"] != [s.layer for s in layers]:
        c.fail(
            "topology.moe_layers",
            f"does not list the layers of experts.layers ({[s.layer for s in layers]})",
        )
    count = n * len(layers)
    if "count" in e and c.int_(e["count"], "experts.count") != count:
        c.fail(
            "experts.count", f"is {e['count']}, but {len(layers)} layers of {n} experts are {count}"
        )
    if "bytes" in e and c.int_(e["bytes"], "experts.bytes") != count * record.stride:
        c.fail(
            "experts.bytes",
            f"is {e['bytes']}, but {count} records of {record.stride} bytes are {count * record.stride}",
        )
    if "order" in e:
        c.str_(e["order"], "experts.order", choices=("layer-major",))
    return n, tuple(layers)


def _checksum_range(c: _Check, algorithm: Any, name: str) -> tuple[str, int]:
    algorithm = c.str_(algorithm, name, choices=tuple(HASHES))
    return algorithm, (1 << CHECKSUM_BITS.get(algorithm, 64)) - 1


def _checksums(c: _Check, value: Any, count: int) -> tuple[str, list[int]]:
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


def _file_entry(c: _Check, value: Any, name: str, file: str) -> dict[str, Any]:
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


def _projections(
    c: _Check, record: RecordLayout, topology: dict[str, Any], quantization: dict[str, Any]
) -> dict[str, tuple[int, int, str] | None]:
    """Check that the record's components are exactly the parameters of mlx-lm's expert
    module (topology.expert_kind), each projection packed as quantization.experts says,
    with shapes that fit each other and topology.expert_hidden_size, in one float dtype.
    Returns each projection's (bits, group_size, mode) as the shapes hold it, or None for
    float weights."""
    kind = topology["expert_kind"]
    projs = PROJECTIONS[kind]
    declared = _declared_packing(quantization["experts"], projs)
    parts: dict[str, dict[str, Component]] = {p: {} for p in projs}
    where: dict[str, str] = {}
    for i, comp in enumerate(record.components):
        proj, _, part = comp.name.rpartition(".")
        if proj not in parts or part not in PARTS:
            c.fail(
                f"record.components[{i}].name",
                f"is {_show(comp.name)}, not a parameter of mlx-lm's {kind} "
                f"({', '.join(projs)} with {', '.join(PARTS)})",
            )
        parts[proj][part] = comp
        where[comp.name] = f"record.components[{i}] ({comp.name})"

    def bad(comp: Component, problem: str) -> NoReturn:
        c.fail(where[comp.name], problem)

    for p in projs:
        if "weight" not in parts[p]:
            c.fail("record.components", f"lack {p}.weight")
        if len(parts[p]["weight"].shape) != 2:
            bad(parts[p]["weight"], f"has shape {list(parts[p]['weight'].shape)}, not [out, in]")
    # The projections chain: hidden -> inner (gate/up, fc1) -> hidden (down, fc2).
    out = {p: parts[p]["weight"].shape[0] for p in projs}
    hidden, inner = out[projs[-1]], out[projs[0]]
    dims = {p: (hidden, inner) if p == projs[-1] else (inner, hidden) for p in projs}
    if inner != topology["expert_hidden_size"]:
        c.fail(
            "topology.expert_hidden_size",
            f"is {topology['expert_hidden_size']}, but {projs[0]}.weight has {inner} rows",
        )
    floats: set[str] = set()
    held: dict[str, tuple[int, int, str] | None] = {}
    for p in projs:
        rows, cols = dims[p]
        spec, exact = declared[p]
        mode = None if spec is None else spec[2]
        what = "float experts" if spec is None else f"{mode}-quantized experts"
        required = {"weight"} | ({"scales"} if spec else set())
        required |= {"biases"} if mode == "affine" else set()
        missing = sorted(required - set(parts[p]))
        if missing:
            c.fail("record.components", f"lack {p}.{missing[0]}, which {what} have")
        allowed = required | {"bias"} | ({"global_scale"} if mode == "nvfp4" else set())
        for part, comp in parts[p].items():
            if part not in allowed:
                bad(comp, f"is not a parameter of {what}")
        w = parts[p]["weight"]
        if w.shape[0] != rows:
            bad(w, f"has {w.shape[0]} rows, {rows} expected")
        if spec is None:
            if w.dtype not in FLOAT_DTYPES or w.shape[1] != cols:
                bad(w, f"is {w.dtype}{list(w.shape)}; {what} have a float [{rows}, {cols}]")
            floats.add(w.dtype)
            held[p] = None
        else:
            packed = w.shape[1] * 32
            if w.dtype != "uint32" or packed % cols or packed // cols not in QUANT_BITS:
                bad(w, f"is {w.dtype}{list(w.shape)}, not {cols} inputs packed in uint32 words")
            s = parts[p]["scales"]
            if len(s.shape) != 2 or s.shape[0] != rows or cols % s.shape[1]:
                bad(s, f"has shape {list(s.shape)}, not [{rows}, {cols} / group size]")
            if mode == "affine":
                b = parts[p]["biases"]
                if s.dtype not in FLOAT_DTYPES or (b.dtype, b.shape) != (s.dtype, s.shape):
                    bad(b, f"is {b.dtype}{list(b.shape)}, unlike scales {s.dtype}{list(s.shape)}")
                floats.add(s.dtype)
            elif s.dtype != "uint8":
                bad(s, f"is {s.dtype}; {mode} scales are uint8")
            got = (packed // cols, cols // s.shape[1], str(mode))
            if exact and got != spec:
                c.fail(
                    "quantization.experts",
                    "says {}-bit, group {} {} for {}, but the records hold {}-bit, group {} {}".format(
                        *spec, p, *got
                    ),
                )
            held[p] = got
        if "bias" in parts[p]:
            b = parts[p]["bias"]
            if b.dtype not in FLOAT_DTYPES or b.shape != (rows,):
                bad(b, f"is {b.dtype}{list(b.shape)}, not a float [{rows}]")
            floats.add(b.dtype)
        if "global_scale" in parts[p]:
            g = parts[p]["global_scale"]
            if (g.dtype, g.shape) != ("float32", ()):
                bad(g, f"is {g.dtype}{list(g.shape)}, not one float32")
    if len(floats) > 1:
        c.fail("record.components", f"mix float dtypes ({', '.join(sorted(floats))})")
    wanted = quantization.get("float_dtype")
    if wanted is not None and floats and floats != {wanted}:
        c.fail("quantization.float_dtype", f"is {wanted}, the records hold {', '.join(floats)}")
    return held


def _declared_packing(
    experts: dict[str, Any] | None, projs: tuple[str, ...]
) -> dict[str, tuple[tuple[int, int, str] | None, bool]]:
    """{projection: ((bits, group_size, mode) or None for float, exact)} as
    quantization.experts declares it (validated by _quantization). ``exact``: the records
    must hold exactly that. Vaults copied from an MLX source before "projections" was
    recorded state only the source's default packing, which its experts may override:
    config.json's entries are checked for those instead."""
    if experts is None:
        return {p: (None, True) for p in projs}
    per = experts.get("projections")
    if isinstance(per, dict):
        return {p: (None if per.get(p) is None else _packing(per[p]), True) for p in projs}
    exact = not experts.get("copied_from_source", False)
    return {p: (_packing(experts), exact) for p in projs}


def _packing(e: dict[str, Any]) -> tuple[int, int, str]:
    return e["bits"], e["group_size"], e.get("mode", "affine")


def _check_config(config: Any, m: Manifest, where: str) -> dict[str, Any]:
    """config.json against the manifest, where the engine relies on both: the model type,
    sizes, expert count and top-k that build mlx-lm's model and bound token ids, the
    quantization each expert projection is built with, and the types of the fields the
    engine reads itself. Returns the config; VaultError naming the field otherwise."""
    c = _Check(where)
    if not isinstance(config, dict):
        raise VaultError(f"{where} must hold a JSON object, not {_show(config)}; {_FIX}")
    t = m.topology
    if config.get("model_type") != t["model_type"]:
        c.fail(
            "model_type",
            f"is {_show(config.get('model_type'))}, the manifest's is {_show(t['model_type'])}",
        )
    # (keys, value, required): conversion read the topology from the required ones, or
    # mlx-lm built the model from them, so they were there (a layer or kv-head count may
    # have come from elsewhere).
    same: list[tuple[tuple[str, ...], Any, bool]] = [
        (("vocab_size",), t["vocab_size"], True),
        (("hidden_size",), t["hidden_size"], True),
        (("num_hidden_layers",), t["num_layers"], False),
        (_EXPERT_COUNT_KEYS, m.num_experts, True),
        (_TOP_K_KEYS, t["experts_per_token"], True),
    ]
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim"):
        if t.get(key) is not None:
            same.append(((key,), t[key], key != "num_key_value_heads"))
    for keys, want, required in same:
        for key in keys:
            got = config.get(key)
            if got is not None and (type(got) is not int or got != want):
                c.fail(key, f"is {_show(got)}, the manifest says {want}")
        if required and all(config.get(key) is None for key in keys):
            c.fail(" or ".join(keys), f"is missing (the manifest says {want})")
    if t.get("max_position_embeddings") is not None:
        c.key(config, "max_position_embeddings", "")
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim"):
        c.opt_int(config.get(key), key, 1, _DIM_MAX)
    c.opt_int(config.get("max_position_embeddings"), "max_position_embeddings", 1)
    if config.get("tie_word_embeddings") is not None:
        c.bool_(config["tie_word_embeddings"], "tie_word_embeddings")
    eos = config.get("eos_token_id")
    if isinstance(eos, list):
        for i, token in enumerate(c.list_(eos, "eos_token_id", 0, 1024)):
            c.int_(token, f"eos_token_id[{i}]", 0, _DIM_MAX)
    else:
        c.opt_int(eos, "eos_token_id", 0, _DIM_MAX)
    q = config.get("quantization")
    default = None
    if q:
        q = c.obj(q, "quantization")
        default = _quant_entry(c, q, "quantization")
    # mlx-lm's rule: a module's own entry (false: float), else the default.
    held = m.projections()
    for spec in m.layers:
        for proj, have in held.items():
            path = f"{spec.module}.{proj}"
            entry = q.get(path, True) if q else False
            built = None
            if isinstance(entry, dict):
                built = _quant_entry(c, entry, f"quantization[{path!r}]")
            elif entry is True:
                built = default
            elif entry is not False and entry is not None:
                c.fail(f"quantization[{path!r}]", f"must be false or an object, not {_show(entry)}")
            if built != have:
                said = "float" if built is None else "{}-bit group {} {}".format(*built)
                held_as = "float" if have is None else "{}-bit group {} {}".format(*have)
                c.fail(
                    f"quantization of {path}",
                    f"is {said}, but the records hold {held_as} weights",
                )
    return config


# Vaults whose missing backbone checksum was already warned about, in this process.
_UNCHECKED_WARNED: set[str] = set()
# A file changed again within the file system's timestamp granularity of an earlier hash
# could look unchanged; files younger than this are hashed every time.
_RACY_NS = 2 * 10**9


class Vault:
    """An opened vault: its manifest and paths, validated and checked for completeness.

    Opening reads manifest.json and config.json and validates both (docs/vault-format.md,
    "Validation"), and stats the other files; it never reads records or the backbone
    (``verify_backbone`` does). Raises VaultError naming the file, the problem and the fix
    when the directory is not a complete, consistent v1 vault.
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
        """config.json (read afresh), checked: valid JSON holding an object, equal to the
        checksum the manifest records for it (vaults made since it does), consistent with
        the manifest where the engine relies on both. Raises VaultError naming the fix."""
        data = _read_limited(self.config_path, MAX_CONFIG_BYTES)
        entry = self.manifest.config.get("checksum")
        if entry is not None and digest(entry["algorithm"], data) != entry["value"]:
            raise VaultError(
                f"{self.config_path} does not match its checksum in the manifest: it was "
                f"changed or damaged after conversion; {_FIX}"
            )
        return _check_config(
            _parse_json(data, self.config_path), self.manifest, str(self.config_path)
        )

    @classmethod
    def open(cls, path: Path | str) -> Vault:
        """Open and validate the vault at ``path`` (see the class docstring)."""
        path = Path(path)
        # A replacement killed between its two renames (no atomic exchange here) left the
        # vault aside: put it back before deciding there is none (smoe.util.files).
        with contextlib.suppress(OSError):
            recover_dir(path, complete=lambda p: (p / MANIFEST).is_file())
        if not path.is_dir():
            raise VaultError(f"{path} is not a directory; give a vault made by 'smoe convert'")
        mpath = path / MANIFEST
        if not mpath.exists():
            raise VaultError(
                f"{path} is not a vault ({MANIFEST} is missing; an interrupted conversion "
                "leaves none): run 'smoe convert' again"
            )
        raw = _parse_json(_read_limited(mpath, MAX_MANIFEST_BYTES), mpath)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise VaultError(f"{mpath} is not an S-MoE vault manifest")
        if raw.get("version") == VERSION:  # another version is refused as such below
            _check_signature(raw, mpath)
        manifest = Manifest.from_json(raw, str(mpath))
        vault = cls(path, manifest)
        for f in (vault.backbone_path, vault.config_path, vault.experts_path):
            if not f.is_file():
                raise VaultError(
                    f"{f} is missing; the vault is incomplete: convert the model again"
                )
        size = vault.experts_path.stat().st_size
        if size != manifest.experts_bytes:
            raise VaultError(
                f"{vault.experts_path} has {size} bytes, the manifest says "
                f"{manifest.experts_bytes}: the vault is truncated or altered; convert again"
            )
        size = vault.backbone_path.stat().st_size
        if size != manifest.backbone["bytes"]:
            raise VaultError(
                f"{vault.backbone_path} has {size} bytes, the manifest says "
                f"{manifest.backbone['bytes']}: the vault is truncated or altered; convert again"
            )
        vault.config()
        return vault

    def verify_backbone(self, force: bool = False) -> bool:
        """Check backbone.safetensors against the checksum the manifest records for it.

        The file is hashed once per change of it: a good result is remembered in
        stats/backbone-verified.json, keyed by the file's size, times and inode, where the
        vault is writable (elsewhere it is hashed each time); ``force`` hashes regardless.
        A vault made before the checksum was recorded is not checked: a warning, once per
        process, suggests converting it again. Returns whether a checksum was checked.
        Raises VaultError naming the file and the fix when it does not match.
        """
        entry = self.manifest.backbone.get("checksum")
        path = self.backbone_path
        if entry is None:
            if str(self.path.absolute()) not in _UNCHECKED_WARNED:
                _UNCHECKED_WARNED.add(str(self.path.absolute()))
                # Attributed to "smoe", not to the line that called (often an executor's).
                warnings.warn_explicit(
                    f"{path} is not checked: the vault was made before S-MoE recorded a "
                    "backbone checksum; convert the model again ('smoe convert') to have it "
                    "checked",
                    UserWarning,
                    filename="smoe",
                    lineno=0,
                )
            return False
        try:
            before = os.stat(path)
            key = {
                "file": BACKBONE_FILE,
                **_stat_key(before),
                "algorithm": entry["algorithm"],
                "value": entry["value"],
            }
            if not force and self._memo() == key:
                return True
            actual = file_checksum(path, entry["algorithm"])["value"]
            after = os.stat(path)
        except OSError as e:
            raise VaultError(f"{path} is unreadable ({e.strerror}); {_FIX}") from None
        if actual != entry["value"]:
            raise VaultError(
                f"{path} does not match its checksum in the manifest ({entry['algorithm']} "
                f"{actual:x}, expected {entry['value']:x}): the file is damaged or was "
                f"changed after conversion; {_FIX}"
            )
        newest = max(after.st_mtime_ns, after.st_ctime_ns)
        if _stat_key(after) == _stat_key(before) and time.time_ns() - newest > _RACY_NS:
            try:
                self.stats_dir.mkdir(exist_ok=True)
                write_json_atomic(self.stats_dir / BACKBONE_MEMO, key)
            except OSError:
                pass  # a read-only vault is hashed on every open
        return True

    def _memo(self) -> Any:
        try:
            return json.loads((self.stats_dir / BACKBONE_MEMO).read_bytes())
        except (OSError, ValueError, RecursionError):
            return None


def _stat_key(st: os.stat_result) -> dict[str, int]:
    """What changes when a file's bytes do (ctime too, which no one can set back)."""
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
        "device": st.st_dev,
    }
