"""`smoe convert`: turn a Hugging Face or MLX checkpoint into a vault, one layer at a time.

Peak memory stays near one MoE layer's experts: the source is opened lazily and each
layer's expert tensors are evaluated, written as records and dropped before the next.
Everything goes into a temporary sibling directory that is renamed into place only when
complete, with manifest.json written last; an interrupted run leaves no vault behind.
"""

from __future__ import annotations

import datetime as _dt
import errno
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

import smoe
from smoe.errors import SmoeError
from smoe.models.checkpoint import SourceCheckpoint, free_bytes, open_checkpoint
from smoe.util.files import (
    fsync_path,
    recover_dir,
    remove_tree,
    replace_dir,
    sweep_stale,
    temp_path,
    write_json_atomic,
)
from smoe.vault.format import (
    BACKBONE_FILE,
    CONFIG_FILE,
    EXPERTS_FILE,
    MANIFEST,
    STATS_DIR,
    ExpertLayer,
    Manifest,
    RecordLayout,
    Vault,
    file_checksum,
)
from smoe.vault.integrity import DEFAULT_ALGORITHM, digest
from smoe.vault.tensorfile import array_bytes, dtype_name, write_safetensors

BITS_CHOICES = (2, 3, 4, 6, 8, 16)
GROUP_CHOICES = (32, 64, 128)
DTYPE_CHOICES = ("bfloat16", "float16", "float32")
DEFAULT_BITS = 4
DEFAULT_GROUP = 64

# Files copied from the source as they are: tokenizer, chat template, generation config.
_COPY_SUFFIXES = (".json", ".model", ".txt", ".jinja", ".tiktoken", ".jsonl")
_NEVER_COPY = {"config.json", "model.safetensors.index.json"}

Progress = Callable[[str, int, int], None]  # (stage, done, total)


@dataclass(frozen=True)
class ConvertOptions:
    """What `smoe convert` was asked for. None means: what the source implies."""

    bits: int | None = None  # experts: 16 keeps float weights; None: 4 (or the source's)
    group_size: int | None = None  # None: 64 (or the source's)
    dtype: str | None = None  # float tensors' dtype; None: the source's
    backbone_bits: int | None = None  # None: backbone stays as in the source
    backbone_group_size: int = DEFAULT_GROUP
    force: bool = False


def _check_options(opts: ConvertOptions, source_q: dict[str, Any] | None) -> tuple[int, int]:
    """The experts' (bits, group_size), or a SmoeError naming the bad option."""
    if opts.bits is not None and opts.bits not in BITS_CHOICES:
        raise SmoeError(f"--bits {opts.bits} is not supported; choose one of {BITS_CHOICES}")
    if opts.group_size is not None and opts.group_size not in GROUP_CHOICES:
        raise SmoeError(
            f"--group-size {opts.group_size} is not supported; choose one of {GROUP_CHOICES}"
        )
    if opts.dtype is not None and opts.dtype not in DTYPE_CHOICES:
        raise SmoeError(f"--dtype {opts.dtype} is not supported; choose one of {DTYPE_CHOICES}")
    if opts.backbone_bits is not None and opts.backbone_bits not in BITS_CHOICES[:-1]:
        raise SmoeError(f"--backbone-bits must be one of {BITS_CHOICES[:-1]}")
    if opts.backbone_group_size not in GROUP_CHOICES:
        raise SmoeError(f"--backbone-group-size must be one of {GROUP_CHOICES}")
    if source_q is None:
        return opts.bits or DEFAULT_BITS, opts.group_size or DEFAULT_GROUP
    sb, sg = source_q.get("bits"), source_q.get("group_size")
    if (opts.bits not in (None, sb)) or (opts.group_size not in (None, sg)):
        raise SmoeError(
            f"the source is already MLX-quantized ({sb} bits, group {sg}) and is copied byte "
            "for byte, never re-quantized: drop --bits/--group-size"
        )
    if opts.backbone_bits is not None:
        raise SmoeError("the source is already MLX-quantized: drop --backbone-bits")
    return int(sb), int(sg)


def _float_dtype(name: str | None) -> mx.Dtype | None:
    return None if name is None else getattr(mx, name)


def _cast(a: mx.array, dtype: mx.Dtype | None) -> mx.array:
    if dtype is not None and mx.issubdtype(a.dtype, mx.floating) and a.dtype != dtype:
        return a.astype(dtype)
    return a


class _Plan:
    """Which source parameters go where, and how each is encoded (all still lazy)."""

    def __init__(self, ck: SourceCheckpoint, opts: ConvertOptions) -> None:
        self.ck = ck
        self.opts = opts
        self.source_q = ck.quantization
        self.bits, self.group_size = _check_options(opts, self.source_q)
        if opts.group_size is None and self.source_q is None:
            self.group_size = self._default_group_size()
        self.dtype = _float_dtype(opts.dtype)
        self.prefixes = [m.path + "." for m in ck.experts]
        self.router_gates = self._router_gates()
        self.quantizable = self._quantizable_backbone()
        # e.g. {"model.layers.1.mlp.switch_mlp": ["down_proj", "gate_proj", "up_proj"]}
        self.projections = {
            m.path: sorted(
                {
                    k[len(m.path) + 1 :].rsplit(".", 1)[0]
                    for k in ck.params
                    if k.startswith(m.path + ".")
                }
            )
            for m in ck.experts
        }
        # How an MLX source packs each expert projection (None: float), checked to be the
        # same in every MoE layer: records share one layout.
        self.source_packing = self._source_packing() if self.source_q is not None else {}

    def _source_packing(self) -> dict[str, dict[str, Any] | None]:
        """{projection: {'mode', 'bits', 'group_size'} or None} of the source's experts, as
        mlx-lm's loader quantized them (per-path entries, else inferred from the shapes)."""
        modules = dict(self.ck.model.named_modules())

        def packing(path: str) -> dict[str, Any] | None:
            m = modules.get(path)
            if getattr(m, "bits", None) is None:
                return None
            return {
                "mode": getattr(m, "mode", "affine"),
                "bits": m.bits,
                "group_size": m.group_size,
            }

        def describe(p: dict[str, Any] | None) -> str:
            return "float" if p is None else f"{p['bits']} bits, group {p['group_size']}"

        first: dict[str, dict[str, Any] | None] | None = None
        first_path = ""
        for m in self.ck.experts:
            layer = {proj: packing(f"{m.path}.{proj}") for proj in self.projections[m.path]}
            if first is None:
                first, first_path = layer, m.path
                continue
            for proj, p in layer.items():
                if p != first.get(proj):
                    raise SmoeError(
                        f"the MLX source packs its experts differently from layer to layer "
                        f"({first_path}.{proj}: {describe(first.get(proj))}; {m.path}.{proj}: "
                        f"{describe(p)}), as mixed recipes like mixed_3_6 do, and a vault needs "
                        "one expert layout: convert the float checkpoint instead "
                        "(smoe convert HF_DIR VAULT --bits N), or a model quantized uniformly"
                    )
        return first or {}

    def _default_group_size(self) -> int:
        """64, or the largest smaller choice that divides every expert's input dimension
        (a small model's 32-wide experts cannot use 64); --group-size overrides."""
        first = self.ck.experts[0].path + "."
        dims = [
            a.shape[-1]
            for k, a in self.ck.params.items()
            if k.startswith(first) and k.endswith(".weight") and a.ndim == 3
        ]
        for g in sorted((g for g in GROUP_CHOICES if g <= DEFAULT_GROUP), reverse=True):
            if all(d % g == 0 for d in dims):
                return g
        return DEFAULT_GROUP  # quantizing will say which tensor does not fit

    def _router_gates(self) -> set[str]:
        """Linear layers beside the experts whose outputs are one per expert: the routers."""
        n = self.ck.topology.num_experts
        gates = set()
        for m in self.ck.experts:
            parent = m.path.rsplit(".", 1)[0] + "."
            for name, a in self.ck.params.items():
                if (
                    name.startswith(parent)
                    and name.endswith(".weight")
                    and not any(name.startswith(p) for p in self.prefixes)
                    and a.ndim == 2
                    and a.shape[0] == n
                ):
                    gates.add(name[: -len(".weight")])
        return gates

    def _quantizable_backbone(self) -> set[str]:
        """Backbone modules that --backbone-bits quantizes (never routers or experts)."""
        if self.opts.backbone_bits is None:
            return set()
        gs = self.opts.backbone_group_size
        found = set()
        for name, module in self.ck.model.named_modules():
            w = self.ck.params.get(f"{name}.weight")
            if (
                hasattr(module, "to_quantized")
                and w is not None
                and w.ndim == 2
                and w.shape[-1] % gs == 0
                and f"{name}.scales" not in self.ck.params
                and name not in self.router_gates
                and not any((name + ".").startswith(p) for p in self.prefixes)
            ):
                found.add(name)
        return found

    def expert_tensors(self, module_path: str) -> dict[str, mx.array]:
        """One layer's expert components, stacked [E, ...], popped from the source (lazy)."""
        prefix = module_path + "."
        names = [k for k in self.ck.params if k.startswith(prefix)]
        out: dict[str, mx.array] = {}
        for name in names:
            a = self.ck.params.pop(name)
            short = name[len(prefix) :]
            if self.source_q is not None or self.bits == 16 or not short.endswith(".weight"):
                out[short] = _cast(a, self.dtype)  # an MLX source's packing is kept as is
                continue
            base = short[: -len(".weight")]
            try:
                w, scales, biases = mx.quantize(_cast(a, self.dtype), self.group_size, self.bits)
            except ValueError as e:
                raise SmoeError(
                    f"cannot quantize {name} {tuple(a.shape)} with group size "
                    f"{self.group_size}: {e}; pick another --group-size"
                ) from None
            out[f"{base}.weight"], out[f"{base}.scales"], out[f"{base}.biases"] = w, scales, biases
        return out

    def backbone_tensors(self) -> dict[str, mx.array]:
        """Every non-expert parameter, encoded as asked (lazy)."""
        out: dict[str, mx.array] = {}
        bb, gs = self.opts.backbone_bits, self.opts.backbone_group_size
        for name, a in self.ck.params.items():
            if any(name.startswith(p) for p in self.prefixes):
                continue
            module = name.rsplit(".", 1)[0]
            if name.endswith(".weight") and module in self.quantizable:
                w, s, b = mx.quantize(_cast(a, self.dtype), gs, bb)
                out[name], out[f"{module}.scales"], out[f"{module}.biases"] = w, s, b
            else:
                out[name] = _cast(a, self.dtype)
        return out

    def vault_config(self) -> dict[str, Any]:
        """config.json for the vault: mlx-lm-ready, with a 'quantization' entry that says
        how every quantized module was packed (so mlx-lm itself can load the weights)."""
        config = dict(self.ck.config)
        if self.source_q is not None:
            # Each expert projection's packing made explicit: mlx-lm's converter names only
            # the modules its predicate set apart, and the records are the rest's only trace.
            q = dict(self.source_q)
            for path in self.projections:
                for proj, packing in self.source_packing.items():
                    q[f"{path}.{proj}"] = dict(packing) if packing else False
            config["quantization"] = q
            if "quantization_config" in config:  # mlx-lm's copy for HF tooling
                config["quantization_config"] = q
            return config
        config.pop("quantization", None)
        config.pop("quantization_config", None)
        experts_q = self.bits != 16
        if not experts_q and not self.quantizable:
            return config
        if self.quantizable:
            q: dict[str, Any] = {
                "group_size": self.opts.backbone_group_size,
                "bits": self.opts.backbone_bits,
                "mode": "affine",
            }
        else:
            q = {"group_size": self.group_size, "bits": self.bits, "mode": "affine"}
        per_expert = (
            {"group_size": self.group_size, "bits": self.bits, "mode": "affine"}
            if experts_q
            else False
        )
        for path, projections in self.projections.items():
            for proj in projections:
                q[f"{path}.{proj}"] = per_expert
        for gate in self.router_gates:
            q.setdefault(gate, False)
        config["quantization"] = q
        return config

    def _source_experts_summary(self) -> dict[str, Any] | None:
        """The MLX source's expert packing: one setting, or each projection's (mixed)."""
        packs = list(self.source_packing.values())
        quantized = [p for p in packs if p is not None]
        if not quantized:
            return None
        if len(quantized) == len(packs) and all(p == quantized[0] for p in packs):
            return {**quantized[0], "copied_from_source": True}

        bits = {p["bits"] for p in quantized} | ({16} if len(quantized) < len(packs) else set())
        return {
            "mode": quantized[0]["mode"],
            "bits": "/".join(str(b) for b in sorted(bits)),  # e.g. "4/8" (16: float)
            "group_size": "/".join(str(g) for g in sorted({p["group_size"] for p in quantized})),
            "projections": dict(self.source_packing),
            "copied_from_source": True,
        }

    def quantization_summary(self) -> dict[str, Any]:
        if self.source_q is not None:
            experts: dict[str, Any] | None = self._source_experts_summary()
        elif self.bits == 16:
            experts = None
        else:
            experts = {"mode": "affine", "bits": self.bits, "group_size": self.group_size}
        backbone = (
            {
                "mode": "affine",
                "bits": self.opts.backbone_bits,
                "group_size": self.opts.backbone_group_size,
                "modules": len(self.quantizable),
            }
            if self.quantizable
            # the top-level setting; per-module entries stay in config.json
            else (
                {
                    **{k: v for k, v in self.source_q.items() if not isinstance(v, dict | bool)},
                    "copied_from_source": True,
                }
                if self.source_q
                else None
            )
        )
        return {"experts": experts, "backbone": backbone, "float_dtype": self.opts.dtype}


def _layout_of(tensors: dict[str, mx.array]) -> RecordLayout:
    specs = [(name, dtype_name(a.dtype), tuple(a.shape[1:])) for name, a in tensors.items()]
    return RecordLayout.build(specs)


def _check_same_layout(layout: RecordLayout, tensors: dict[str, mx.array], where: str) -> None:
    got = _layout_of(tensors)
    if got != layout:
        raise SmoeError(
            f"the experts at {where} are shaped unlike the first MoE layer's; vault v1 needs "
            "one expert shape for the whole model (this architecture is not supported yet)"
        )


def _write_layer_records(
    f: Any, tensors: dict[str, mx.array], layout: RecordLayout, num_experts: int
) -> list[int]:
    """Evaluate one layer's expert tensors and append its records; return their checksums
    (DEFAULT_ALGORITHM, of each record's first ``layout.size`` bytes; the rest is zeros).

    Components are evaluated one at a time: each projection's stacked source then lives
    only until its quantized form exists, so peak memory stays below one layer's experts.
    """
    columns = []
    for comp in layout.components:
        a = tensors.pop(comp.name)
        mx.eval(a)
        if a.shape[0] != num_experts:
            raise SmoeError(
                f"expert tensor {comp.name} has {a.shape[0]} experts, expected {num_experts}"
            )
        columns.append((comp, array_bytes(a).reshape(num_experts, comp.nbytes)))
        del a
    record = np.zeros(layout.stride, dtype=np.uint8)
    sums = []
    for e in range(num_experts):
        for comp, col in columns:
            record[comp.offset : comp.offset + comp.nbytes] = col[e]
        sums.append(digest(DEFAULT_ALGORITHM, record[: layout.size]))
        f.write(memoryview(record))
    return sums


def _copy_side_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for p in sorted(src.iterdir()):
        if p.is_file() and p.suffix in _COPY_SUFFIXES and p.name not in _NEVER_COPY:
            shutil.copyfile(p, dst / p.name)
            copied.append(p.name)
    shutil.copyfile(src / "config.json", dst / "source_config.json")
    return copied


def _check_target(dst: Path, force: bool) -> None:
    """Raise SmoeError unless ``dst`` may become a vault. First repairs what killed runs left
    beside it: a --force swap interrupted between its two renames is finished (or undone),
    and their `.NAME.converting-PID` / `.NAME.old-PID` trees are deleted."""
    try:
        recover_dir(dst, complete=lambda p: (p / MANIFEST).is_file())
    except OSError as e:
        raise SmoeError(
            f"{dst} is missing and the vault a killed conversion moved aside beside it cannot "
            f"be put back ({e}); rename the .{dst.name}.old-* directory to {dst.name}"
        ) from None
    sweep_stale(dst.parent, targets=[dst.name])
    if not dst.exists():
        return
    if not dst.is_dir():
        raise SmoeError(f"{dst} exists and is a file; choose another vault path")
    is_vault = (dst / MANIFEST).exists()
    if not is_vault and any(dst.iterdir()):
        raise SmoeError(
            f"{dst} exists and is not a vault; choose another path (--force only replaces vaults)"
        )
    if is_vault and not force:
        raise SmoeError(f"{dst} is already a vault; pass --force to replace it")


def _backbone_bytes(plan: _Plan) -> int:
    """backbone.safetensors as backbone_tensors() will write it: cast to --dtype, the
    --backbone-bits modules packed, the experts (still in ``ck.params``) left out."""
    total = 8
    bits, gs = plan.opts.backbone_bits, plan.opts.backbone_group_size
    for name, a in plan.ck.params.items():
        if any(name.startswith(p) for p in plan.prefixes):
            continue
        floating = mx.issubdtype(a.dtype, mx.floating)
        item = plan.dtype.size if floating and plan.dtype is not None else a.dtype.size
        module = name.rsplit(".", 1)[0]
        if bits is not None and name.endswith(".weight") and module in plan.quantizable:
            rows = a.size // a.shape[-1]
            # packed uint32 words, then scales and biases per group (3 header entries)
            total += rows * a.shape[-1] * bits // 8 + 2 * rows * (a.shape[-1] // gs) * item
            total += 3 * (len(name) + 96)
        else:
            total += a.size * item + len(name) + 96  # data, then its header entry
    return total


def _estimate_bytes(plan: _Plan, layout: RecordLayout) -> int:
    """Bytes the vault will take: the records at their stride, the backbone as written,
    config and side files, the manifest; plus 2% for file-system blocks and metadata."""
    src = plan.ck.path
    records = plan.ck.topology.num_experts * len(plan.ck.experts)
    side = sum(
        p.stat().st_size
        for p in src.iterdir()
        if p.is_file() and p.suffix in _COPY_SUFFIXES and p.name not in _NEVER_COPY
    )
    # config.json (with a quantization entry per expert projection) and source_config.json
    config = 2 * (src / "config.json").stat().st_size
    config += 128 * sum(len(projections) for projections in plan.projections.values())
    manifest = 8192 + 24 * records  # a checksum per record, and the layout
    need = records * layout.stride + _backbone_bytes(plan) + side + config + manifest
    return need + need // 50


def convert(
    src: Path | str,
    dst: Path | str,
    opts: ConvertOptions | None = None,
    progress: Progress | None = None,
) -> Vault:
    """Convert the checkpoint at ``src`` into a vault at ``dst`` and return it opened.

    Raises SmoeError (and subclasses) for bad input: missing/truncated shards, a config
    that contradicts the tensors, unsupported models, an existing target without
    ``force``, a full disk. On any error or interruption the partial output is removed.
    """
    src, dst = Path(src), Path(dst)
    opts = opts or ConvertOptions()
    _check_target(dst, opts.force)
    ck = open_checkpoint(src)
    plan = _Plan(ck, opts)
    vault_config = plan.vault_config()
    ck.model = None  # the model holds the lazy arrays too: drop it so written layers free

    first = plan.expert_tensors(ck.experts[0].path)
    layout = _layout_of(first)
    need = _estimate_bytes(plan, layout)
    free = free_bytes(dst.parent)
    if need > free:
        raise SmoeError(
            f"not enough free space for the vault on {dst.parent}: it needs about "
            f"{need / 1e9:.2f} GB, {free / 1e9:.2f} GB are free; free some or choose another path"
        )

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(dst, "converting")
    remove_tree(tmp)  # a dead run's that had our PID
    tmp.mkdir()
    try:
        checksums: list[int] = []
        total = len(ck.experts)
        with open(tmp / EXPERTS_FILE, "wb") as f:
            for i, module in enumerate(ck.experts):
                tensors = first if i == 0 else plan.expert_tensors(module.path)
                first = {}
                _check_same_layout(layout, tensors, module.path)
                checksums += _write_layer_records(f, tensors, layout, ck.topology.num_experts)
                del tensors
                if progress:
                    progress("experts", i + 1, total)
            f.flush()
            os.fsync(f.fileno())

        if progress:
            progress("backbone", 0, 1)
        backbone = plan.backbone_tensors()
        ck.params.clear()
        n_backbone = len(backbone)
        backbone_bytes = write_safetensors(tmp / BACKBONE_FILE, backbone, {"format": "mlx"})
        if progress:
            progress("backbone", 1, 1)

        write_json_atomic(tmp / CONFIG_FILE, vault_config)
        copied = _copy_side_files(src, tmp)
        (tmp / STATS_DIR).mkdir()
        manifest = Manifest(
            topology=ck.topology.to_json(),
            record=layout,
            layers=tuple(ExpertLayer(m.layer, m.path) for m in ck.experts),
            num_experts=ck.topology.num_experts,
            checksums=checksums,
            checksum_algorithm=DEFAULT_ALGORITHM,
            quantization=plan.quantization_summary(),
            source={
                "path": str(src.absolute()),
                "kind": "mlx" if plan.source_q else "hf",
                "bytes": ck.source_bytes,
                "files": [p.name for p in ck.files],
                "copied": copied,
            },
            backbone={
                "file": BACKBONE_FILE,
                "bytes": backbone_bytes,
                "tensors": n_backbone,
                "checksum": file_checksum(tmp / BACKBONE_FILE),  # verified when opened
            },
            config={"file": CONFIG_FILE, "checksum": file_checksum(tmp / CONFIG_FILE)},
            created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            producer=f"smoe {smoe.__version__}",
        )
        for name in copied + ["source_config.json"]:
            fsync_path(tmp / name)
        write_json_atomic(tmp / MANIFEST, manifest.to_json())  # last: now it is a vault
        fsync_path(tmp)
        _check_target(dst, opts.force)  # a vault that appeared meanwhile still needs --force
        replace_dir(tmp, dst)
    except OSError as e:
        remove_tree(tmp)
        if e.errno == errno.ENOSPC:
            raise SmoeError(
                f"the disk holding {dst.parent} filled up while writing the vault; "
                "free some space or choose another path (nothing was left behind)"
            ) from None
        raise
    except BaseException:
        remove_tree(tmp)
        raise
    return Vault.open(dst)
