"""`smoe plan`: before loading anything, whether a model fits a memory budget and how fast
it will run there (docs/plan.md).

The fit is the engine's own arithmetic (smoe.plan.plan, the engine's own call), from
config.json and safetensors headers; the speed is smoe.forecast.speed's model over a disk
probe (smoe.io.disk_probe) and a compute probe (smoe.forecast.probe) and the routing curves at hand (the vault's
popularity counts, else published locality).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from smoe.errors import BudgetTooSmall, SmoeError
from smoe.forecast.probe import PROBE_TOKENS, probe_compute, recorded_compute
from smoe.forecast.speed import Shape, forecast, routing_probabilities
from smoe.io.disk_probe import DEFAULT_WORKERS, auto_workers, probe_disk
from smoe.models.registry import layer_major_prefill
from smoe.plan.budget import (
    KV_STEP,
    Attention,
    BudgetParts,
    backbone_bytes,
    budget_parts_for,
    default_contexts,
    fit,
    pass_bytes,
    pass_tokens,
    pick_context,
    suggest_at_least,
)
from smoe.plan.host_tier import plan_host_tier
from smoe.plan.memory import available_memory
from smoe.plan.options import EngineOptions
from smoe.plan.plan import Plan, device_and_dtype, plan
from smoe.plan.ring import Device, budget_parts, ring_kind, slot_bytes
from smoe.vault.layout import RECORD_ALIGN, RecordLayout
from smoe.vault.names import MANIFEST


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

    bits: int | None = None  # a source folder: the --bits `smoe convert` would use
    probe_seconds: float = 3.0
    probe_requests: int = 4  # compute probe: measured requests (after one warm-up)
    probe_chunks: int = 2  # compute probe: prefill chunks per request
    fresh: bool = False  # measure again rather than reuse cached/recorded figures
    compute: bool = True  # run (or reuse) the compute probe
    progress: Callable[[str], None] | None = None  # told before a probe that takes a while


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


def _needs(
    subject: Subject, o: PlanOptions, dtype: Any, kind: str, context: int, device: Device
) -> BudgetParts:
    """What the engine would budget beside the ring: the engine's own arithmetic
    (smoe.plan.ring.budget_parts) where there is something it can open, else the same parts
    for the vault `smoe convert` would make."""
    if subject.vault is not None:
        return budget_parts(
            subject.vault, dtype, kind=kind, discrete=device.discrete, **_sizing(o, context)
        )
    dsize = int(dtype.size)
    landing = 2 * o.io_workers * (subject.layout.stride + RECORD_ALIGN) if kind == "staged" else 0
    return budget_parts_for(
        subject.config,
        subject.backbone(dsize),
        dsize,
        context=context,
        sequences=o.max_batch,
        kv_bits=o.kv_bits,
        prefill_chunk=o.prefill_chunk,
        landing=landing,
        device_memory=device.discrete,
    )


def _engine_options(o: PlanOptions, context: int | None = None) -> EngineOptions:
    """The options an engine run with these flags would get (what `smoe run` passes)."""
    return EngineOptions(
        memory=o.memory,
        host_memory=o.host_memory,
        device=o.device,
        dtype=o.dtype,
        max_context=context if context is not None else o.context,
        kv_bits=o.kv_bits,
        max_batch=o.max_batch,
        prefill_chunk=o.prefill_chunk,
        workers=o.io_workers,
    )


def _engine_plan(subject: Subject, o: PlanOptions) -> Plan | None:
    """The engine's own plan (smoe.plan.plan, the call Engine.open makes), or None where
    there is nothing it can open (a `--bits` preview) or the budget is too small (the fit
    below then words the refusal)."""
    if subject.vault is None:
        return None
    try:
        return plan(subject.vault, _engine_options(o), workers=o.io_workers)
    except BudgetTooSmall:
        return None


def _sizing(o: PlanOptions, context: int) -> dict[str, Any]:
    """The options the parts beside the ring are sized from, as the engine passes them."""
    return {
        "max_batch": o.max_batch,
        "max_context": context,
        "kv_bits": o.kv_bits,
        "prefill_chunk": o.prefill_chunk,
        "workers": o.io_workers,
    }


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
    mlx_device, device, dtype = device_and_dtype(_engine_options(o))  # (checks kv_bits)
    device_name = "gpu" if mlx_device == mx.gpu else "cpu"
    dtype_name = str(dtype).split(".")[-1]
    kind = ring_kind("auto", subject.layout, dtype, device)
    per_slot = slot_bytes(kind, subject.layout, dtype)
    attn = Attention.of(subject.config)
    s = subject.shape
    every = s.records * per_slot
    engine = _engine_plan(subject, o)
    if engine is not None:
        context, default_context, ring = engine.max_context, engine.default_context, engine.ring
    else:  # no engine plan: the preview's context as the engine would pick it

        def fits(c: int) -> bool:
            if subject.vault is not None:  # the engine refused every default context
                return False
            fixed = _needs(subject, o, dtype, kind, c, device).fixed
            return o.memory is None or _parse(o.memory) >= fixed + s.top_k * per_slot

        context, default_context = pick_context(o.context, attn.max_context, fits)
        ring = None
    needs = _needs(subject, o, dtype, kind, context, device)
    fixed = needs.fixed
    # Both figures at fixed contexts, not the one this --memory got (the default halves
    # to fit it): the smallest the run commands accept, and every expert at the default.
    contexts = [context] if o.context is not None else default_contexts(attn.max_context)
    smallest = _needs(subject, o, dtype, kind, contexts[-1], device).fixed + s.top_k * per_slot
    every_fixed = _needs(subject, o, dtype, kind, contexts[0], device).fixed
    if o.memory is not None:
        memory = _parse(o.memory)
    elif ring is not None:  # the engine's default ring, and the process around it
        memory = fixed + ring.slots * per_slot
    else:
        memory = _default_memory(fixed, every, device)
    out: dict[str, Any] = {
        "model": str(path),
        "kind": subject.kind,
        "device": device_name,
        "dtype": dtype_name,
        "ring": kind,
        "experts": _experts(s, per_slot),
        "smallest_memory_bytes": smallest,
        "smallest_memory": suggest_at_least(smallest),
        "smallest_memory_context": contexts[-1],
        "memory_for_every_expert": suggest_at_least(every_fixed + every),
        "every_expert_context": contexts[0],
        "context_limit": context_limit(
            lambda c: _needs(subject, o, dtype, kind, c, device),
            s.top_k,
            per_slot,
            memory,
            attn.max_context,
        ),
    }
    try:
        budget = fit(memory, needs, slot_bytes=per_slot, min_slots=s.top_k, num_records=s.records)
        budget = dataclasses.replace(budget, default_context=default_context)
    except SmoeError as e:
        out |= {"fits": False, "fit": None, "why": str(e)}
        return out
    out |= {"fits": True, "fit": budget.to_json(), "line": budget.line()}
    tier = plan_host_tier(
        subject.layout,
        s.records,
        o.host_memory,
        ring_kind=kind,
        ring_slots=budget.slots,
        dtype=dtype,
        discrete=device.discrete,
        distributed=False,
    )
    out["host_tier"] = {"images": tier.images, "bytes": tier.nbytes, "line": tier.line()}
    tokens = pass_tokens(context, o.prefill_chunk)
    out["prompt_pass"] = {  # a layer-major prefill: its tokens and what they hold
        "tokens": tokens,
        "bytes": pass_bytes(attn, int(dtype.size), tokens),
        "layer_major": layer_major_prefill(subject.config),
    }
    out["disk"] = disk = await _probe_disk(subject, o)
    q, source = routing_probabilities(s, subject.popularity)
    out["routing"] = source
    compute = None
    if o.compute and subject.kind == "vault":
        compute = await _compute(subject.vault, o, device_name, dtype_name, budget.slots, disk)
    out["compute"] = compute
    if compute is None:
        out["why_no_speed"] = (
            "convert the model first: compute is measured on a vault"
            if subject.kind != "vault"
            else "the compute probe was skipped"
        )
    else:
        out["forecast"] = forecast(s, budget.slots, q, disk, compute, o.prefill_chunk, o.io_workers)
    out["cold_fill_s"] = round(budget.slots * s.record_bytes / (disk["gbps"] * 1e9), 4)
    return out


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


def _parse(memory: int | str) -> int:
    from smoe.util.sizes import parse_size

    value = parse_size(memory)
    if not math.isfinite(value) or value <= 0:
        raise SmoeError(f"--memory must be positive, not {memory}")
    return value
