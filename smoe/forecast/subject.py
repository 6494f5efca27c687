"""What `smoe plan` plans for: a vault, a checkpoint folder run as it is, or that folder as
`smoe convert --bits` would make it, as far as the plan needs to know it; and the budget's
parts beside the ring for it (the engine's own arithmetic, smoe.plan)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from smoe.errors import SmoeError
from smoe.forecast.speed import Shape
from smoe.plan.budget import BudgetParts, backbone_bytes, budget_parts_for
from smoe.plan.ring import Device, budget_parts
from smoe.vault.layout import RECORD_ALIGN, RecordLayout
from smoe.vault.names import MANIFEST


@dataclass
class Subject:
    """A vault or a source folder, as far as the plan needs it."""

    path: Path
    kind: str  # "vault", "source" (run as it is) or "converted" (as `smoe convert` makes it)
    config: dict[str, Any]
    layout: RecordLayout
    shape: Shape
    backbone: Any  # (dsize) -> bytes in memory
    probe_file: Path  # a large file of the model, to probe the disk it sits on
    popularity: np.ndarray | None
    vault: Any = None  # what the engine opens (a Vault, or a Source for a download)


@dataclass(frozen=True)
class Sizing:
    """The options the parts beside the ring are sized from, as the engine takes them."""

    max_batch: int
    kv_bits: int | None
    prefill_chunk: int
    workers: int


def open_subject(path: Path, bits: int | None) -> Subject:
    """A vault (a folder with manifest.json), a HF/MLX checkpoint folder run as it is (as
    `smoe generate SRC` runs it), or, with ``bits``, that folder as `smoe convert --bits`
    would make it. Raises SmoeError/VaultError naming the fix for anything else."""
    from smoe.sched.popularity import Popularity
    from smoe.vault.format import Vault
    from smoe.vault.source import Source

    if (path / MANIFEST).exists():
        if bits is not None:
            raise SmoeError("--bits is for a source folder; a vault's records are already made")
        return _runnable(Vault.open(path), "vault", Popularity)
    if bits is None:
        return _runnable(Source.open(path), "source", Popularity)
    from smoe.vault.convert import ConvertOptions, source_shape

    src = source_shape(path, ConvertOptions(bits=bits))
    ck = src.checkpoint
    tensors = src.backbone

    def backbone(dsize: int) -> int:
        import mlx.core as mx

        return sum(
            a.size * dsize if mx.issubdtype(a.dtype, mx.floating) else a.nbytes
            for a in tensors.values()
        )

    top = ck.topology
    return Subject(
        path,
        "converted",
        ck.config,
        src.layout,
        Shape(len(ck.experts), top.num_experts, top.experts_per_token, src.layout.stride),
        backbone,
        max(ck.files, key=lambda f: f.stat().st_size),
        None,
    )


def _runnable(vault: Any, kind: str, popularity: Any) -> Subject:
    """A Subject for what the engine can open as it is: a vault or a download (Source)."""
    m = vault.manifest
    header = vault.backbone_header()
    files = getattr(vault, "index", None)
    probe_file = max(files.files, key=lambda f: f.stat().st_size) if files else vault.experts_path
    return Subject(
        vault.path,
        kind,
        vault.config(),
        m.record,
        Shape(len(m.layers), m.num_experts, m.shape.experts_per_token, m.record.stride),
        lambda dsize: backbone_bytes(header, dsize),
        probe_file,
        popularity(vault).counts,
        vault,
    )


def subject_parts(
    subject: Subject, sizing: Sizing, dtype: Any, kind: str, context: int, device: Device
) -> BudgetParts:
    """What the engine would budget beside the ring at ``context``: the engine's own
    arithmetic (smoe.plan.ring.budget_parts) where there is something it can open, else
    the same parts for the vault `smoe convert` would make."""
    if subject.vault is not None:
        return budget_parts(
            subject.vault,
            dtype,
            kind=kind,
            discrete=device.discrete,
            max_batch=sizing.max_batch,
            max_context=context,
            kv_bits=sizing.kv_bits,
            prefill_chunk=sizing.prefill_chunk,
            workers=sizing.workers,
        )
    dsize = int(dtype.size)
    landing = 2 * sizing.workers * (subject.layout.stride + RECORD_ALIGN) if kind == "staged" else 0
    return budget_parts_for(
        subject.config,
        subject.backbone(dsize),
        dsize,
        context=context,
        sequences=sizing.max_batch,
        kv_bits=sizing.kv_bits,
        prefill_chunk=sizing.prefill_chunk,
        landing=landing,
        device_memory=device.discrete,
    )
