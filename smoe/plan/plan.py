"""``plan``: the one place an engine's layout is decided, for the engine and `smoe plan`.

In order: the options against the model, the device (MLX's default is set to it) and the
compute dtype, the KV-cache width the device allows, the device's kernel rules and whether
drafts can run under them, the batch, then the longest context the budget holds (or the
one asked) and the ring planned at it. Every refusal is a SmoeError naming the fix;
BudgetTooSmall names the smallest budget that works.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from smoe.errors import BudgetTooSmall
from smoe.plan.budget import Attention, kv_group_size, pick_context
from smoe.plan.host_tier import HostTierPlan, plan_host_tier
from smoe.plan.options import EngineOptions
from smoe.plan.ring import (
    Device,
    RingPlan,
    batch_size,
    check_draft,
    check_kv_bits,
    choose_device,
    current_device,
    kernel_rules,
    plan_ring,
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
    host_tier: HostTierPlan  # the host tier's images (none: 0)


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


def plan(model: Any, options: EngineOptions, workers: int, batchable: bool = False) -> Plan:
    """The Plan for ``model`` (a Vault, or a Source run as one) under ``options``, with
    ``workers`` I/O threads (their landing buffers are budgeted). ``batchable``: whether
    S-MoE runs this architecture's attention one row per call (drafts under kernel rules
    need it; only ``options.draft`` reads it). Raises SmoeError (BudgetTooSmall for a budget too small)."""
    m, o = model.manifest, options
    o.check(m.shape.experts_per_token, m.num_experts)
    config = model.config()
    mlx_device, device, dtype = device_and_dtype(o)
    # How this device's kernels treat a call's rows: batched and verify passes are shaped
    # by them so each row gets its solo bits (smoe.compute.solo_rows).
    rules = kernel_rules(device, o.solo_rows)
    check_draft(o.draft, rules, batchable)
    max_batch = batch_size(o.max_batch, device)

    def ring_at(context: int) -> RingPlan:
        return plan_ring(
            model,
            requested=o.ring,
            dtype=dtype,
            device=device,
            memory=o.memory,
            slots=o.slots,
            max_batch=max_batch,
            max_context=context,
            kv_bits=o.kv_bits,
            prefill_chunk=o.prefill_chunk,
            workers=workers,
            host_reserve=o.host_reserve,
        )

    def fits(context: int) -> bool:
        try:
            ring_at(context)
        except BudgetTooSmall:
            return False
        return True

    limit = Attention.of(config).max_context
    max_context, default = pick_context(o.max_context, limit, fits)
    ring = ring_at(max_context)  # a refusal names the smallest budget
    if ring.fit is not None and default:
        ring = dataclasses.replace(ring, fit=dataclasses.replace(ring.fit, default_context=True))
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
        host_tier=plan_host_tier(
            m.record,
            m.num_records,
            o.host_memory,
            ring_kind=ring.kind,
            ring_slots=ring.slots,
            dtype=dtype,
            discrete=device.discrete,
            distributed=o.distributed is not None,
        ),
    )
