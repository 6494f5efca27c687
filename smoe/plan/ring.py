"""Which ring an engine builds, and how many slots: decided from the device, the vault's
record format, the compute dtype and the memory there is. No MLX arrays are made here.

- Kind (``ExpertRing``): staged on a discrete GPU (CUDA: its kernels must read device
  memory) and wherever the records' float components are not in the compute dtype (kernels
  would otherwise convert the whole ring on every call); unified otherwise (reads land in
  place). ``ring="unified"`` or ``"staged"`` forces one, refused where it cannot work.
- Size: ``slots``, else what ``memory`` leaves: the whole process's budget less the
  backbone, the KV caches and working memory (smoe.plan.budget; on a discrete GPU, its
  memory: the host's runtime is not counted), else the default budget: every expert if
  they fit, else as many as do. On a discrete GPU what fits is 90% of its free memory less
  the backbone and room for the KV caches; elsewhere half the available memory beside the
  backbone (``available_memory``: cgroup limits included). A budget that cannot hold the
  rest and one layer's top-k makes a plan that does not fit (``RingPlan.fits``), which
  ``plan_ring`` refuses naming the smallest that works.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smoe.errors import BudgetTooSmall, SmoeError
from smoe.io.open import reader_host_bytes
from smoe.io.ring import needs_conversion
from smoe.io.staged import StagedRing
from smoe.io.unified import UnifiedRing
from smoe.plan.budget import (
    Attention,
    BudgetParts,
    Fit,
    backbone_bytes,
    budget_parts_for,
    fit,
    kv_bytes,
)
from smoe.plan.memory import available_memory
from smoe.util.sizes import format_bytes, round_size, slots_for_budget
from smoe.vault.format import Vault
from smoe.vault.layout import RECORD_ALIGN, RecordLayout

KINDS = ("auto", "unified", "staged")


@dataclass(frozen=True)
class Device:
    """What the plan needs to know of the compute device."""

    gpu: bool  # a GPU (CUDA or Metal)
    discrete: bool  # with memory of its own (CUDA), not Apple's unified memory
    free_memory: int | None = None  # bytes free on a discrete GPU


@dataclass(frozen=True)
class RingPlan:
    kind: str  # "unified" or "staged"
    slots: int
    slot_bytes: int  # memory one slot takes in this kind of ring
    fit: Fit | None = None  # how a whole-process --memory divided (None: --slots or default)

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def fits(self) -> bool:
        """Whether --memory holds it (a ring without --memory always does)."""
        return self.fit is None or self.fit.fits

    def checked(self) -> RingPlan:
        """This plan, or BudgetTooSmall naming the smallest budget that works."""
        if self.fit is not None and not self.fit.fits:
            raise BudgetTooSmall(self.fit.refusal())
        return self


def choose_device(name: str | None) -> Any:
    """The MLX device to compute on (``name``: "cpu", "gpu" or None for MLX's default),
    made the default device of this thread. SmoeError if this MLX build lacks it."""
    import mlx.core as mx

    if name is None:
        return mx.default_device()
    device = getattr(mx, name)
    if not mx.is_available(device):
        raise SmoeError(
            f"this MLX build has no {name} backend; install mlx[cuda] (NVIDIA) or use "
            "macOS (Metal) for a GPU, or leave the device out"
        )
    mx.set_default_device(device)
    return device


def check_kv_bits(kv_bits: int | None, device: Device) -> None:
    """--kv-bits needs mlx-lm's quantized attention: MLX 0.32's CUDA backend has no
    quantized matmul for a prompt chunk over a quantized cache (measured: mlx-lm's own
    generate_step fails there too; tests/gpu/test_gpu.py), so a CUDA GPU refuses it up front."""
    if kv_bits is not None and device.discrete:
        raise SmoeError(
            "--kv-bits does not run on a CUDA GPU: MLX's CUDA backend has no kernel for "
            "attention over a quantized KV cache; leave --kv-bits out there (it runs on the "
            "CPU and on Apple GPUs)"
        )


def kernel_rules(device: Device, forced: bool | None) -> Any:
    """How the device's kernels treat a call's rows (smoe.compute.solo_rows.KernelRules),
    or None where a row's bits never depend on the rows sharing its call (MLX's CPU
    kernels: tests/exact/test_batching.py). ``forced``: True applies CUDA's measured rules
    anywhere (the CPU tests run the path this way), False none (the cost of the path is
    measured against it); None: CUDA's on a CUDA GPU, solo call shapes on another GPU
    (Metal: not measured), none on the CPU."""
    from smoe.compute.solo_rows import CUDA, SOLO_SHAPES

    if forced is not None:
        return CUDA if forced else None
    if device.discrete:
        return CUDA
    return SOLO_SHAPES if device.gpu else None


def check_draft(draft: str | None, rules: Any, batchable: bool) -> None:
    """--draft is lossless where a verify pass's row j gets plain decode's bits: on the
    CPU always; under kernel rules (a GPU) each row is shaped as its own decode step,
    which runs attention one row at a time and needs the architecture's per-row
    attention (smoe.compute.rowwise, ``batched_decode`` in smoe.models.registry)."""
    if draft is not None and rules is not None and not batchable:
        raise SmoeError(
            "--draft on a GPU needs per-row attention, which S-MoE has not tested for this "
            "architecture: leave --draft out there, or add --device cpu"
        )


CPU_BATCH = 8  # generations decoded together unless told otherwise


def batch_size(max_batch: int | None, device: Device) -> int:
    """Generations decoded together: ``max_batch``, else 8 on every device. A batched
    pass is exact where each row gets the single-row arithmetic: MLX's CPU kernels
    (tests/exact/test_batching.py), and on a GPU the kernel rules (smoe.compute.solo_rows)."""
    return CPU_BATCH if max_batch is None else max_batch


def current_device(device: Any) -> Device:
    """The Device of an MLX device (reads the free memory of a CUDA GPU: what the driver
    reports free plus MLX's cache of freed buffers, which this process reuses; a closed
    engine's ring sits there until the cache is cleared)."""
    import mlx.core as mx

    if device != mx.gpu:
        return Device(gpu=False, discrete=False)
    if mx.metal.is_available():
        return Device(gpu=True, discrete=False)
    free = int(mx.device_info(mx.gpu).get("free_memory", 0)) + int(mx.get_cache_memory())
    return Device(gpu=True, discrete=True, free_memory=free)


def _float_dtypes(layout: RecordLayout) -> str:
    return ", ".join(sorted({c.dtype for c in layout.components if "float" in c.dtype}))


def ring_kind(requested: str, layout: RecordLayout, dtype: Any, device: Device) -> str:
    if requested not in KINDS:
        raise SmoeError(f"ring must be auto, unified or staged, not {requested!r}")
    convert = needs_conversion(layout, dtype)
    if requested == "unified" and device.discrete:
        raise SmoeError(
            "a unified ring cannot be used on a CUDA GPU (its kernels do not see slots "
            "rewritten through host memory): use --ring staged, or leave --ring out"
        )
    if requested == "unified" and convert:
        name = str(dtype).split(".")[-1]
        raise SmoeError(
            f"the vault's float components ({_float_dtypes(layout)}) are not in the compute "
            f"dtype ({name}), so a unified ring would convert the whole ring on every call: "
            f"use --ring staged (the default), or convert the vault with --dtype {name}"
        )
    if requested == "auto":
        return "staged" if device.discrete or convert else "unified"
    return requested


def slot_bytes(kind: str, layout: RecordLayout, dtype: Any) -> int:
    if kind == "staged":
        return StagedRing.slot_bytes(layout, dtype)
    return UnifiedRing.slot_bytes(layout)


def budget_parts(
    vault: Vault,
    dtype: Any,
    *,
    kind: str,
    discrete: bool = False,
    max_batch: int = 8,
    max_context: int | None = None,
    kv_bits: int | None = None,
    prefill_chunk: int = 64,
    workers: int = 4,
    host_reserve: int = 0,
) -> BudgetParts:
    """The budget's parts beside the ring (smoe.plan.budget.budget_parts_for) for this vault: its
    backbone as loaded, a staged ring's host landing buffers (2 per worker), and, for a
    model run from its shards, the reader's bounce buffers (host memory, so not in a
    discrete GPU's budget), and ``host_reserve`` (what the caller keeps: `smoe serve`'s
    clients)."""
    dsize = int(dtype.size)
    landing = 2 * workers * (vault.manifest.record.stride + RECORD_ALIGN) if kind == "staged" else 0
    if not discrete:  # host memory: a download's reader's bounce buffers, the caller's
        landing += reader_host_bytes(vault, workers) + host_reserve
    return budget_parts_for(
        vault.config(),
        loaded_backbone_bytes(vault, dtype),
        dsize,
        context=max_context,
        sequences=max_batch,
        kv_bits=kv_bits,
        prefill_chunk=prefill_chunk,
        landing=landing,
        device_memory=discrete,
    )


def loaded_backbone_bytes(vault: Vault, dtype: Any) -> int:
    """The backbone's bytes once loaded at compute ``dtype`` (``backbone_bytes`` under the
    vault's FloatPolicy)."""
    from smoe.compute.model import float_policy

    return backbone_bytes(vault.backbone_header(), float_policy(vault, dtype))


def kv_room(config: dict[str, Any], dtype: Any, max_batch: int, max_context: int | None) -> int:
    """Bytes of KV cache for ``max_batch`` sequences at the model's full context (or
    ``max_context``): what a GPU keeps free for them beside the ring."""
    attn = Attention.of(config)
    return kv_bytes(attn, int(dtype.size), min(max_context or 1 << 30, attn.max_context), max_batch)


def gpu_room(
    vault: Vault, dtype: Any, device: Device, max_batch: int, max_context: int | None
) -> int:
    """Bytes a ring may take on a discrete GPU: 90% of its free memory, less the backbone
    and the KV caches' room (at most a quarter of the free memory)."""
    free = device.free_memory or 0
    kv = min(kv_room(vault.config(), dtype, max_batch, max_context), free // 4)
    return max(0, int(free * 0.9) - int(vault.manifest.backbone["bytes"]) - kv)


def ring_for(
    vault: Vault,
    *,
    requested: str,
    dtype: Any,
    device: Device,
    memory: int | None = None,
    slots: int | None = None,
    max_batch: int = 8,
    max_context: int | None = None,
    kv_bits: int | None = None,
    prefill_chunk: int = 64,
    workers: int = 4,
    host_reserve: int = 0,
) -> RingPlan:
    """The ring to build (module docstring), whether or not ``memory`` (the whole process's
    budget, in bytes: smoe.plan.budget) holds it: the plan's ``fit`` says how it divides
    and whether it fits (``plan_ring`` refuses one that does not). Raises SmoeError naming
    the fix for a ring the GPU cannot hold, a --slots out of range, or a ring kind that
    cannot work."""
    m = vault.manifest
    kind = ring_kind(requested, m.record, dtype, device)
    per_slot = slot_bytes(kind, m.record, dtype)
    top_k = m.shape.experts_per_token
    room = gpu_room(vault, dtype, device, max_batch, max_context) if device.discrete else None
    budget: Fit | None = None
    if slots is not None:
        count = _asked_slots(slots, top_k, m.num_records)
    elif memory is None:
        default = _default_budget(vault, per_slot, top_k, room, dtype)  # >= one top-k
        count = slots_for_budget(default, per_slot, max_slots=m.num_records)
    else:
        needs = budget_parts(
            vault,
            dtype,
            kind=kind,
            discrete=device.discrete,
            max_batch=max_batch,
            max_context=max_context,
            kv_bits=kv_bits,
            prefill_chunk=prefill_chunk,
            workers=workers,
            host_reserve=host_reserve,
        )
        budget = fit(memory, needs, slot_bytes=per_slot, min_slots=top_k, num_records=m.num_records)
        if not budget.fits:  # refused as too small, before the GPU's room is asked
            return RingPlan(kind, budget.slots, per_slot, budget)
        count = budget.slots
    if room is not None and count * per_slot > room:
        whole = room + (budget.fixed if budget is not None else 0)  # --memory is the whole
        raise SmoeError(
            f"a ring of {format_bytes(count * per_slot)} does not fit this GPU: "
            f"{format_bytes(room)} are free beside the backbone and the KV caches; use "
            f"--memory {round_size(whole, up=False)} or less, or --device cpu"
        )
    return RingPlan(kind, count, per_slot, budget)


def plan_ring(vault: Vault, **sizing: Any) -> RingPlan:
    """``ring_for`` (the same keywords), refusing a budget too small for the backbone, KV,
    working memory and one layer's top-k: BudgetTooSmall naming the smallest that works."""
    return ring_for(vault, **sizing).checked()


def _asked_slots(slots: int, top_k: int, num_records: int) -> int:
    """--slots, refused (SmoeError naming the fix) below one token's top-k or past the
    last record."""
    if slots < top_k:
        raise SmoeError(f"slots={slots} is below one token's top-{top_k}; use {top_k} or more")
    if slots > num_records:  # a slot past the last record holds nothing, ever
        raise SmoeError(
            f"slots={slots} is more than the {num_records} experts this model has; "
            f"use at most {num_records} (a ring of every expert)"
        )
    return int(slots)


def _default_budget(vault: Vault, per_slot: int, top_k: int, room: int | None, dtype: Any) -> int:
    m = vault.manifest
    floor = top_k * per_slot
    if room is not None:  # a discrete GPU
        if room < floor:
            raise SmoeError(
                f"this GPU has room for {format_bytes(room)} of experts beside the backbone, "
                f"less than one layer's top-{top_k} ({format_bytes(floor)}): free GPU "
                "memory, or use --device cpu"
            )
        return room
    available = available_memory()
    if available is None:
        return m.num_records * per_slot
    spare = available // 2 - loaded_backbone_bytes(vault, dtype)
    return max(spare, floor)
