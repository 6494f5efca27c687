"""``assess`` and ``plan``: the one place an engine's layout is decided, for the engine and
`smoe plan`.

In order: the options against the model, the device (MLX's default is set to it) and the
compute dtype, the KV-cache width the device allows, the device's kernel rules and whether
drafts can run under them, the batch, then the longest context the budget holds (or the
one asked) and the ring planned at it. ``assess`` returns that Plan whether or not the
budget holds it (``Plan.fits``; `smoe plan` prints it either way); ``plan`` refuses one
that does not (BudgetTooSmall naming the smallest budget that works). Every other
refusal is a SmoeError naming the fix, from both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from smoe.plan.budget import (
    Attention,
    BudgetParts,
    Fit,
    fit,
    kv_group_size,
    pick_context,
    smallest_context,
)
from smoe.plan.host_tier import NONE as NO_HOST_TIER
from smoe.plan.host_tier import HostTierPlan, plan_host_tier
from smoe.plan.options import EngineOptions
from smoe.plan.ring import (
    Device,
    RingPlan,
    batch_size,
    budget_parts,
    check_draft,
    check_kv_bits,
    choose_device,
    current_device,
    kernel_rules,
    ring_for,
)


@dataclass(frozen=True)
class Plan:
    """What an engine over one model will be, decided before it starts anything."""

    mlx_device: Any  # mx.cpu or mx.gpu (made MLX's default by ``plan``)
    device: Device  # its facts: a GPU, with memory of its own, how much free
    dtype: Any  # the compute dtype (an mx.Dtype)
    rules: Any  # the device's kernel rules (smoe.compute.solo_rows.KernelRules) or None
    max_batch: int  # generations decoded together
    max_context: int  # tokens each sequence's KV cache is sized for
    default_context: bool  # max_context is the default's (none was asked for)
    kv_group_size: int  # the quantized KV cache's group size (64 when not quantized)
    ring: RingPlan  # kind, slots, slot bytes, and how a --memory divided (``ring.fit``)
    host_tier: HostTierPlan  # the host tier's images (none: 0, and none where it does not fit)
    # How the whole process's memory divides: --memory's (``ring.fit``), else the ring
    # planned without one and the rest, as one budget (what `smoe plan` shows).
    budget: Fit
    # The least --memory these options run in: at the context asked, else the last one the
    # default halves to (budget.smallest_context), so the same whatever --memory is.
    smallest_memory: int

    @property
    def fits(self) -> bool:
        """Whether --memory holds the ring beside the rest (no --memory: it does)."""
        return self.ring.fits

    def checked(self) -> Plan:
        """This plan, or BudgetTooSmall naming the smallest budget that works."""
        self.ring.checked()
        return self


def device_and_dtype(options: EngineOptions) -> tuple[Any, Device, Any]:
    """The MLX device (made MLX's default), its facts and the compute dtype: float32 on
    the CPU, bfloat16 on a GPU, unless ``options.dtype`` says; refuses a KV-cache width
    the device cannot run. Needs no model (`smoe plan` previews a conversion with it)."""
    import mlx.core as mx

    mlx_device = choose_device(options.device)
    device = current_device(mlx_device)
    dtype = getattr(mx, options.dtype or ("bfloat16" if mlx_device == mx.gpu else "float32"))
    check_kv_bits(options.kv_bits, device)
    return mlx_device, device, dtype


def assess(model: Any, options: EngineOptions, workers: int, batchable: bool = False) -> Plan:
    """The Plan for ``model`` (a Vault, or a Source run as one) under ``options``, with
    ``workers`` I/O threads (their landing buffers are budgeted), whether or not its
    --memory holds it (``Plan.fits``). ``batchable``: whether S-MoE runs this
    architecture's attention one row per call (drafts under kernel rules need it; only
    ``options.draft`` reads it). Raises SmoeError naming the fix for any option that
    cannot work here, but never for the budget's size."""
    m, o = model.manifest, options
    o.check(m.shape.experts_per_token, m.num_experts)
    config = model.config()
    mlx_device, device, dtype = device_and_dtype(o)
    # How this device's kernels treat a call's rows: batched and verify passes are shaped
    # by them so each row gets its solo bits (smoe.compute.solo_rows).
    rules = kernel_rules(device, o.solo_rows)
    check_draft(o.draft, rules, batchable)
    max_batch = batch_size(o.max_batch, device)
    sizing: dict[str, Any] = {
        "max_batch": max_batch,
        "kv_bits": o.kv_bits,
        "prefill_chunk": o.prefill_chunk,
        "workers": workers,
        "host_reserve": o.host_reserve,
    }

    def ring_at(context: int) -> RingPlan:
        return ring_for(
            model,
            requested=o.ring,
            dtype=dtype,
            device=device,
            memory=o.memory_bytes,
            slots=o.slots,
            max_context=context,
            **sizing,
        )

    limit = Attention.of(config).max_context
    max_context, default = pick_context(o.max_context, limit, lambda c: ring_at(c).fits)
    ring = ring_at(max_context)  # where none fits: the last context's, naming the smallest
    if ring.fit is not None and default:
        ring = dataclasses.replace(ring, fit=dataclasses.replace(ring.fit, default_context=True))

    def parts_at(context: int) -> BudgetParts:  # backbone, KV and working at this context
        return budget_parts(
            model, dtype, kind=ring.kind, discrete=device.discrete, max_context=context, **sizing
        )

    top_k = m.shape.experts_per_token
    smallest = parts_at(smallest_context(o.max_context, limit)).fixed + top_k * ring.slot_bytes
    budget = ring.fit or _as_one_budget(parts_at(max_context), ring, top_k, m.num_records)
    return Plan(
        mlx_device=mlx_device,
        device=device,
        dtype=dtype,
        rules=rules,
        max_batch=max_batch,
        max_context=max_context,
        default_context=default,
        kv_group_size=kv_group_size(config) if o.kv_bits else 64,
        ring=ring,
        host_tier=_host_tier(model, o, ring, dtype, device),
        budget=dataclasses.replace(budget, default_context=default),
        smallest_memory=smallest,
    )


def plan(model: Any, options: EngineOptions, workers: int, batchable: bool = False) -> Plan:
    """``assess``, refusing a budget too small: the Plan the engine opens with. Raises
    SmoeError naming the fix (BudgetTooSmall, naming the smallest budget that works, for a
    --memory that cannot hold the backbone, KV, working memory and one layer's top-k)."""
    return assess(model, options, workers, batchable).checked()


def _host_tier(
    model: Any, o: EngineOptions, ring: RingPlan, dtype: Any, device: Device
) -> HostTierPlan:
    """The host tier beside ``ring`` (smoe.plan.host_tier); none beside a ring the budget
    does not hold (its refusal comes first)."""
    if not ring.fits:
        return NO_HOST_TIER
    m = model.manifest
    return plan_host_tier(
        m.record,
        m.num_records,
        o.host_memory_bytes,
        ring_kind=ring.kind,
        ring_slots=ring.slots,
        dtype=dtype,
        discrete=device.discrete,
        distributed=o.distributed is not None,
    )


def _as_one_budget(parts: BudgetParts, ring: RingPlan, top_k: int, num_records: int) -> Fit:
    """A ring planned without --memory beside ``parts``, as the one budget that divides so."""
    return fit(
        parts.fixed + ring.nbytes,
        parts,
        slot_bytes=ring.slot_bytes,
        min_slots=top_k,
        num_records=num_records,
    )
