"""`smoe convert`: turn a Hugging Face or MLX checkpoint into a vault, one layer at a time.

Peak memory stays near one MoE layer's experts: the source is opened lazily and each
layer's expert tensors are evaluated, written as records and dropped before the next.
Everything goes into a temporary sibling directory that is renamed into place only when
complete, with manifest.json written last; an interrupted run leaves no vault behind.
Which source tensor goes where, and how each is encoded, is decided by smoe.vault.plan.
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

import smoe
from smoe.errors import SmoeError, WriteError
from smoe.models.checkpoint import SourceCheckpoint, free_bytes, open_checkpoint
from smoe.util.files import (
    fsync_path,
    make_temp_dir,
    remove_tree,
    replace_dir,
    temp_path,
    tidy_target,
    write_json_atomic,
)
from smoe.util.sizes import format_bytes
from smoe.vault.convert_options import BITS_CHOICES as BITS_CHOICES  # re-exported
from smoe.vault.convert_options import DEFAULT_GROUP, check_options
from smoe.vault.convert_options import DTYPE_CHOICES as DTYPE_CHOICES  # re-exported
from smoe.vault.convert_options import GROUP_CHOICES as GROUP_CHOICES  # re-exported
from smoe.vault.convert_options import ConvertOptions as ConvertOptions  # re-exported
from smoe.vault.format import Vault, file_checksum
from smoe.vault.integrity import DEFAULT_ALGORITHM, digest
from smoe.vault.layout import RecordLayout
from smoe.vault.manifest import ExpertLayer, Manifest
from smoe.vault.names import BACKBONE_FILE, CONFIG_FILE, EXPERTS_FILE, MANIFEST, STATS_DIR
from smoe.vault.plan import ConversionPlan
from smoe.vault.tensorfile import array_bytes, dtype_name, write_safetensors

# Files copied from the source as they are: tokenizer, chat template, generation config.
_COPY_SUFFIXES = (".json", ".model", ".txt", ".jinja", ".tiktoken", ".jsonl")
# (A source's manifest.json would be overwritten by the vault's, and its checksum fail.)
_NEVER_COPY = {"config.json", "model.safetensors.index.json", MANIFEST}

Progress = Callable[[str, int, int], None]  # (stage, done, total)


def _default_group_size(ck: SourceCheckpoint) -> int:
    """64, or the largest smaller choice that divides every expert's input dimension
    (a small model's 32-wide experts cannot use 64); --group-size overrides."""
    first = ck.experts[0].path + "."
    dims = [
        a.shape[-1]
        for k, a in ck.params.items()
        if k.startswith(first) and k.endswith(".weight") and a.ndim == 3
    ]
    for g in sorted((g for g in GROUP_CHOICES if g <= DEFAULT_GROUP), reverse=True):
        if all(d % g == 0 for d in dims):
            return g
    return DEFAULT_GROUP  # quantizing will say which tensor does not fit


def _make_plan(ck: SourceCheckpoint, opts: ConvertOptions) -> ConversionPlan:
    """The plan for ``ck``: the options checked against it first (SmoeError naming a bad
    one), the experts' group size chosen to fit them where none was asked."""
    bits, group_size = check_options(opts, ck.quantization)
    if opts.group_size is None and ck.quantization is None:
        group_size = _default_group_size(ck)
    return ConversionPlan(ck, opts, bits, group_size)


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
        f.write(record.data)
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
    tidy_target(dst, lambda p: (p / MANIFEST).is_file(), "vault")
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


def _estimate_bytes(plan: ConversionPlan, layout: RecordLayout) -> int:
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
    need = records * layout.stride + plan.backbone_bytes() + side + config + manifest
    return need + need // 50


@dataclass(frozen=True)
class SourceShape:
    """What `convert` would make of a checkpoint, known without reading a weight."""

    checkpoint: SourceCheckpoint
    layout: RecordLayout  # one expert's record
    backbone: dict[str, mx.array]  # the backbone's tensors as encoded (lazy: shapes, dtypes)


def source_shape(src: Path | str, opts: ConvertOptions | None = None) -> SourceShape:
    """The record layout and backbone ``convert(src, ..., opts)`` would write (`smoe plan`
    on a source folder). Raises SmoeError as convert does for a bad source or option."""
    ck = open_checkpoint(Path(src))
    plan = _make_plan(ck, opts or ConvertOptions())
    layout = _layout_of(plan.expert_tensors(ck.experts[0].path))
    return SourceShape(ck, layout, plan.backbone_tensors())


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
    plan = _make_plan(ck, opts)
    vault_config = plan.vault_config()
    ck.model = None  # the model holds the lazy arrays too: drop it so written layers free

    first = plan.expert_tensors(ck.experts[0].path)
    layout = _layout_of(first)
    _check_free_space(plan, layout, dst.parent)

    try:
        tmp = make_temp_dir(dst, "converting")
    except OSError as e:  # a file where a folder must be, a read-only or virtual file system
        raise WriteError("the vault", dst, e, temp_path(dst, "converting")) from e
    try:
        checksums = _write_experts(tmp / EXPERTS_FILE, plan, first, layout, progress)
        backbone = _write_backbone(tmp / BACKBONE_FILE, plan, progress)
        write_json_atomic(tmp / CONFIG_FILE, vault_config)
        copied = _copy_side_files(src, tmp)
        (tmp / STATS_DIR).mkdir()
        manifest = _manifest(plan, src, layout, checksums, backbone, copied, tmp)
        for name in copied + ["source_config.json"]:
            fsync_path(tmp / name)
        write_json_atomic(tmp / MANIFEST, manifest.to_json())  # last: now it is a vault
        fsync_path(tmp)
        _check_target(dst, opts.force)  # a vault that appeared meanwhile still needs --force
        replace_dir(tmp, dst)
    except OSError as e:  # a full disk, an I/O error: one line naming the path and errno
        remove_tree(tmp)
        raise WriteError("the vault", dst, e, tmp) from e
    except BaseException:
        remove_tree(tmp)
        raise
    return Vault.open(dst)


def _check_free_space(plan: ConversionPlan, layout: RecordLayout, parent: Path) -> None:
    """SmoeError unless ``parent``'s file system has room for the vault."""
    need = _estimate_bytes(plan, layout)
    free = free_bytes(parent)
    if need > free:
        raise SmoeError(
            f"not enough free space for the vault on {parent}: it needs about "
            f"{format_bytes(need)}, {format_bytes(free)} are free; free some or choose another "
            "path"
        )


def _write_experts(
    path: Path,
    plan: ConversionPlan,
    first: dict[str, mx.array],
    layout: RecordLayout,
    progress: Progress | None,
) -> list[int]:
    """Write experts.bin, one MoE layer at a time, fsynced; return every record's checksum.
    ``first`` holds the first layer's tensors, already taken from the source: writing a
    layer empties its dict, so no layer outlives its records."""
    ck = plan.ck
    checksums: list[int] = []
    total = len(ck.experts)
    with open(path, "wb") as f:
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
    return checksums


def _write_backbone(path: Path, plan: ConversionPlan, progress: Progress | None) -> dict[str, Any]:
    """Write backbone.safetensors from what is left of the source (which is then dropped);
    return its manifest entry."""
    if progress:
        progress("backbone", 0, 1)
    backbone = plan.backbone_tensors()
    plan.ck.params.clear()
    n_backbone = len(backbone)
    backbone_bytes = write_safetensors(path, backbone, {"format": "mlx"})
    if progress:
        progress("backbone", 1, 1)
    return {
        "file": BACKBONE_FILE,
        "bytes": backbone_bytes,
        "tensors": n_backbone,
        "checksum": file_checksum(path),  # verified when opened
    }


def _manifest(
    plan: ConversionPlan,
    src: Path,
    layout: RecordLayout,
    checksums: list[int],
    backbone: dict[str, Any],
    copied: list[str],
    tmp: Path,
) -> Manifest:
    """The manifest of the vault written into ``tmp``."""
    ck = plan.ck
    return Manifest(
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
            # Checked whenever the tokenizer loads (Vault.verify_side_files).
            "checksums": {name: file_checksum(tmp / name) for name in copied},
        },
        backbone=backbone,
        config={"file": CONFIG_FILE, "checksum": file_checksum(tmp / CONFIG_FILE)},
        created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        producer=f"smoe {smoe.__version__}",
    )
