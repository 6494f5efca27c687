"""`smoe plan`: before loading anything, whether a model fits a memory budget and how fast
it will run there (docs/plan.md).

The fit is the engine's own plan (smoe.plan.plan.assess, the call the engine makes too),
printed as it is, from config.json and safetensors headers; the speed is
smoe.forecast.speed's model over a disk probe (smoe.io.disk_probe) and a compute probe
(smoe.forecast.probe) and the routing curves at hand (the vault's popularity counts, else
published locality).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from smoe.errors import SmoeError
from smoe.forecast.probe import PROBE_TOKENS, probe_compute, recorded_compute
from smoe.forecast.speed import Shape, forecast, routing_probabilities
from smoe.forecast.subject import Sizing, Subject, open_subject, subject_parts
from smoe.io.disk_probe import DEFAULT_WORKERS, auto_workers, probe_disk
from smoe.models.registry import layer_major_prefill
from smoe.plan.budget import (
    KV_STEP,
    Attention,
    BudgetParts,
    Fit,
    default_contexts,
    fit,
    pass_bytes,
    pass_tokens,
    pick_context,
    smallest_context,
)
from smoe.plan.host_tier import NONE as NO_HOST_TIER
from smoe.plan.host_tier import HostTierPlan, plan_host_tier
from smoe.plan.memory import available_memory
from smoe.plan.options import EngineOptions
from smoe.plan.plan import assess, device_and_dtype
from smoe.plan.ring import Device, ring_kind, slot_bytes
from smoe.util.sizes import as_written, round_size


@dataclass
class PlanOptions:
    memory: int | str | None = None  # the whole process's budget; None: the engine's default
    device: str | None = None  # "cpu", "gpu"; None: MLX's default
    dtype: str | None = None  # compute dtype; None: float32 on CPU, bfloat16 on a GPU
    context: int | None = None  # tokens the KV caches are budgeted for; None: the default
    kv_bits: int | None = None  # 4 or 8: mlx-lm's quantized KV cache
    max_batch: int = 1  # sequences decoded together (KV caches kept)
    prefill_chunk: int = 64
    workers: int | None = None  # None: the engine's choice for the disk (disk_probe.auto_workers)
    host_memory: int | str | None = None  # the host tier (smoe.plan.host_tier); None: default

    @property
    def io_workers(self) -> int:
        """The worker count (make_plan resolves None first, as the engine does)."""
        return self.workers or DEFAULT_WORKERS

    @property
    def sizing(self) -> Sizing:
        """What the parts beside the ring are sized from, as the engine is given it."""
        return Sizing(self.max_batch, self.kv_bits, self.prefill_chunk, self.io_workers)

    bits: int | None = None  # a source folder: the --bits `smoe convert` would use
    probe_seconds: float = 3.0
    probe_requests: int = 4  # compute probe: measured requests (after one warm-up)
    probe_chunks: int = 2  # compute probe: prefill chunks per request
    fresh: bool = False  # measure again rather than reuse cached/recorded figures
    compute: bool = True  # run (or reuse) the compute probe
    progress: Callable[[str], None] | None = None  # told before a probe that takes a while


def _engine_options(o: PlanOptions) -> EngineOptions:
    """The options an engine run with these flags would get (what the run commands pass):
    sizes made bytes there, once."""
    return EngineOptions(
        memory=o.memory,
        host_memory=o.host_memory,
        device=o.device,
        dtype=o.dtype,
        max_context=o.context,
        kv_bits=o.kv_bits,
        max_batch=o.max_batch,
        prefill_chunk=o.prefill_chunk,
        workers=o.io_workers,
    )


@dataclass(frozen=True)
class Fitted:
    """The fit `smoe plan` prints: the engine's own where it can open the model."""

    budget: Fit  # how the budget divides, fitting or not (its context, its refusal)
    smallest: int  # the least --memory the run accepts (the same whatever --memory is)
    host_tier: HostTierPlan


@dataclass(frozen=True)
class RingSizing:
    """The ring `smoe plan` sizes, and the options it sizes the rest with."""

    kind: str
    per_slot: int  # bytes a slot takes
    dtype: Any
    device: Device
    sizing: Sizing

    def parts(self, subject: Subject, context: int) -> BudgetParts:
        return subject_parts(subject, self.sizing, self.dtype, self.kind, context, self.device)


def fitted(subject: Subject, o: PlanOptions, options: EngineOptions, ring: RingSizing) -> Fitted:
    """The engine's own plan (smoe.plan.plan.assess, the call Engine.open makes) where it
    can open the model; for a `--bits` preview, the same arithmetic for the vault `smoe
    convert` would make."""
    if subject.vault is not None:
        plan = assess(subject.vault, options, workers=o.io_workers)
        return Fitted(plan.budget, plan.smallest_memory, plan.host_tier)
    s, limit = subject.shape, Attention.of(subject.config).max_context

    def at(context: int, memory: int) -> Fit:
        needs = ring.parts(subject, context)
        return fit(
            memory, needs, slot_bytes=ring.per_slot, min_slots=s.top_k, num_records=s.records
        )

    memory = options.memory_bytes
    context, default = pick_context(
        o.context, limit, lambda c: memory is None or at(c, memory).fits
    )
    if memory is None:
        memory = _default_memory(
            ring.parts(subject, context).fixed, s.records * ring.per_slot, ring.device
        )
    budget = dataclasses.replace(at(context, memory), default_context=default)
    smallest = (
        ring.parts(subject, smallest_context(o.context, limit)).fixed + s.top_k * ring.per_slot
    )
    tier = NO_HOST_TIER
    if budget.fits:
        tier = plan_host_tier(
            subject.layout,
            s.records,
            options.host_memory_bytes,
            ring_kind=ring.kind,
            ring_slots=budget.slots,
            dtype=ring.dtype,
            discrete=ring.device.discrete,
            distributed=False,
        )
    return Fitted(budget, smallest, tier)


def context_limit(needs_at: Any, top_k: int, per_slot: int, memory: int, limit: int) -> int:
    """The longest context (in the caches' 256-token steps, at most the model's ``limit``)
    at which ``memory`` holds ``needs_at(context)`` and one layer's top-k slots; 0 if none."""
    lo, hi = 0, max(1, -(-limit // KV_STEP))
    while lo < hi:  # the most steps that fit
        mid = (lo + hi + 1) // 2
        if needs_at(min(mid * KV_STEP, limit)).fixed + top_k * per_slot <= memory:
            lo = mid
        else:
            hi = mid - 1
    return min(lo * KV_STEP, limit)


def _experts(s: Shape, per_slot: int) -> dict[str, int]:
    return {
        "moe_layers": s.layers,
        "per_layer": s.experts,
        "top_k": s.top_k,
        "records": s.records,
        "record_bytes": s.record_bytes,
        "slot_bytes": per_slot,
        "all_bytes": s.records * per_slot,
    }


def _default_memory(fixed: int, every: int, device: Device) -> int:
    """The engine's default budget as a whole: every expert if it fits (half the available
    memory, or 90% of a GPU's free memory), else what there is."""
    room = int((device.free_memory or 0) * 0.9) if device.discrete else None
    if room is None:
        available = available_memory()
        room = available // 2 if available is not None else fixed + every
    return min(room, fixed + every)


def _check_positive(memory: int | None) -> None:
    """SmoeError for a --memory of 0 bytes or less (the run commands refuse it as too
    small; a plan has nothing to show for it)."""
    if memory is not None and memory <= 0:
        raise SmoeError(f"--memory must be positive, not {as_written(memory, str)}")


async def make_plan(path: Path, o: PlanOptions) -> dict[str, Any]:
    """The whole plan as JSON-able data (docs/plan.md lists its fields)."""
    import mlx.core as mx

    subject = open_subject(path, o.bits)
    if o.workers is None:  # as the engine will choose them, so the plan is the engine's
        size = subject.probe_file.stat().st_size
        workers, _ = await anyio.to_thread.run_sync(
            auto_workers, subject.probe_file, subject.shape.record_bytes, size
        )
        o = dataclasses.replace(o, workers=workers)
    options = _engine_options(o)  # (sizes made bytes)
    mlx_device, device, dtype = device_and_dtype(options)  # (checks kv_bits)
    kind = ring_kind("auto", subject.layout, dtype, device)
    ring = RingSizing(kind, slot_bytes(kind, subject.layout, dtype), dtype, device, o.sizing)
    attn = Attention.of(subject.config)
    s = subject.shape
    every = s.records * ring.per_slot
    got = fitted(subject, o, options, ring)
    _check_positive(options.memory_bytes)
    budget, context = got.budget, got.budget.context
    # The smallest the run commands accept, and every expert at the default context: both
    # at fixed contexts, not the one this --memory got (the default halves to fit it).
    first = context if o.context is not None else default_contexts(attn.max_context)[0]
    every_fixed = ring.parts(subject, first).fixed
    out: dict[str, Any] = {
        "model": str(path),
        "kind": subject.kind,
        "device": "gpu" if mlx_device == mx.gpu else "cpu",
        "dtype": str(dtype).split(".")[-1],
        "ring": kind,
        "experts": _experts(s, ring.per_slot),
        "smallest_memory_bytes": got.smallest,
        "smallest_memory": round_size(got.smallest),
        "smallest_memory_context": smallest_context(o.context, attn.max_context),
        "memory_for_every_expert": round_size(every_fixed + every),
        "every_expert_context": first,
        "context_limit": context_limit(
            lambda c: ring.parts(subject, c), s.top_k, ring.per_slot, budget.total, attn.max_context
        ),
    }
    if not budget.fits:
        out |= {"fits": False, "fit": None, "why": budget.refusal()}
        return out
    out |= {"fits": True, "fit": budget.to_json(), "line": budget.line()}
    tier = got.host_tier
    out["host_tier"] = {"images": tier.images, "bytes": tier.nbytes, "line": tier.line()}
    tokens = pass_tokens(context, o.prefill_chunk)
    out["prompt_pass"] = {  # a layer-major prefill: its tokens and what they hold
        "tokens": tokens,
        "bytes": pass_bytes(attn, int(dtype.size), tokens),
        "layer_major": layer_major_prefill(subject.config),
    }
    await _speed(out, subject, o, budget.slots)
    return out


async def _speed(out: dict[str, Any], subject: Subject, o: PlanOptions, slots: int) -> None:
    """The disk probe, the routing curves, the compute probe (where there is a vault) and
    the forecast over them, into ``out``."""
    s = subject.shape
    out["disk"] = disk = await _probe_disk(subject, o)
    q, source = routing_probabilities(s, subject.popularity)
    out["routing"] = source
    compute = None
    if o.compute and subject.kind == "vault":
        compute = await _compute(subject.vault, o, out["device"], out["dtype"], slots, disk)
    out["compute"] = compute
    if compute is None:
        out["why_no_speed"] = (
            "convert the model first: compute is measured on a vault"
            if subject.kind != "vault"
            else "the compute probe was skipped"
        )
    else:
        out["forecast"] = forecast(s, slots, q, disk, compute, o.prefill_chunk, o.io_workers)
    out["cold_fill_s"] = round(slots * s.record_bytes / (disk["gbps"] * 1e9), 4)


async def _probe_disk(subject: Subject, o: PlanOptions) -> dict[str, Any]:
    """probe_disk on a thread (it blocks for seconds); an unreadable file is a SmoeError."""
    import anyio

    def probe() -> dict[str, Any]:
        s = subject.shape
        return probe_disk(
            subject.probe_file, s.record_bytes, o.io_workers, seconds=o.probe_seconds, fresh=o.fresh
        )

    try:
        return await anyio.to_thread.run_sync(probe)
    except OSError as e:
        raise SmoeError(
            f"cannot probe the disk by reading {subject.probe_file} ({e.strerror or e}); "
            "check that the file is there and readable"
        ) from None


async def _compute(
    vault: Any, o: PlanOptions, device: str, dtype: str, slots: int, disk: dict[str, Any]
) -> dict[str, Any]:
    """The compute figures recorded for this device, dtype and ring, else measured now."""
    recorded = None if o.fresh else recorded_compute(vault, device, dtype, slots)
    if recorded is not None:
        return recorded | {"recorded": True}
    if o.progress is not None:
        o.progress(
            f"measuring compute on this {device} for the forecast: a warm-up request, then "
            f"{o.probe_requests}, each a {o.probe_chunks * o.prefill_chunk + 1}-token prompt "
            f"and {PROBE_TOKENS + 1} tokens decoded (recorded for the next plan of this vault "
            "and ring; --no-compute skips it, Ctrl-C stops it) ..."
        )
    return await probe_compute(
        vault,
        device=device,
        dtype=dtype,
        slots=slots,
        disk_gbps=disk["gbps"],
        workers=o.io_workers,
        requests=o.probe_requests,
        tokens=PROBE_TOKENS,
        chunks=o.probe_chunks,
        progress=o.progress,
    )
