"""Which ring an engine builds and how large: by device, record format and memory."""

from __future__ import annotations

import mlx.core as mx
import pytest

import smoe.plan.ring as plan_module
from smoe.engine import Engine
from smoe.errors import SmoeError
from smoe.plan.ring import Device, gpu_room, plan_ring
from smoe.vault.convert import ConvertOptions, convert

CPU = Device(gpu=False, discrete=False)
APPLE = Device(gpu=True, discrete=False)


def cuda(free: int) -> Device:
    return Device(gpu=True, discrete=True, free_memory=free)


@pytest.fixture(scope="module")
def vaults(hf_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    src = hf_dir("qwen3_moe")
    return {
        "bf16": convert(src, root / "bf16"),
        "f32": convert(src, root / "f32", ConvertOptions(dtype="float32")),
    }


def test_the_kind_follows_the_device_and_the_record_format(vaults):
    bf16, f32 = vaults["bf16"], vaults["f32"]
    assert plan_ring(f32, requested="auto", dtype=mx.float32, device=CPU).kind == "unified"
    assert plan_ring(bf16, requested="auto", dtype=mx.float32, device=CPU).kind == "staged"
    assert plan_ring(bf16, requested="auto", dtype=mx.bfloat16, device=APPLE).kind == "unified"
    assert plan_ring(f32, requested="auto", dtype=mx.bfloat16, device=APPLE).kind == "staged"
    big = cuda(10**12)
    assert plan_ring(bf16, requested="auto", dtype=mx.bfloat16, device=big).kind == "staged"
    assert plan_ring(f32, requested="staged", dtype=mx.float32, device=CPU).kind == "staged"
    with pytest.raises(SmoeError, match="CUDA GPU.*--ring staged"):
        plan_ring(bf16, requested="unified", dtype=mx.bfloat16, device=big)
    with pytest.raises(SmoeError, match=r"\(bfloat16\).*\(float32\).*--dtype float32"):
        plan_ring(bf16, requested="unified", dtype=mx.float32, device=CPU)
    with pytest.raises(SmoeError, match="auto, unified or staged"):
        plan_ring(bf16, requested="fast", dtype=mx.float32, device=CPU)


def test_a_staged_slot_takes_its_components_in_the_compute_dtype(vaults):
    m = vaults["bf16"].manifest
    staged = plan_ring(vaults["bf16"], requested="auto", dtype=mx.float32, device=CPU, slots=4)
    floats = sum(c.nbytes for c in m.record.components if c.dtype == "bfloat16")
    packed = sum(c.nbytes for c in m.record.components if c.dtype != "bfloat16")
    assert staged.slot_bytes == packed + 2 * floats < m.record.stride  # no record padding
    assert staged.nbytes == 4 * staged.slot_bytes


def test_on_a_gpu_the_default_budget_is_its_free_memory(vaults):
    """Every expert when the GPU holds them beside the backbone and KV room; else as many
    as fit; the default never picks a ring that is then refused."""
    v = vaults["bf16"]
    m = v.manifest
    every = plan_ring(v, requested="auto", dtype=mx.bfloat16, device=cuda(10**12))
    assert every.slots == m.num_records
    per_slot = every.slot_bytes
    backbone = v.backbone_path.stat().st_size
    kv = plan_module.kv_room(v.config(), mx.bfloat16, 1, 16)
    free = int((backbone + kv + 5.5 * per_slot) / 0.9) + 1
    device = cuda(free)
    room = gpu_room(v, mx.bfloat16, device, max_batch=1, max_context=16)
    # the KV room is capped at a quarter of the free memory
    assert room == int(free * 0.9) - backbone - min(kv, free // 4)
    device = next(
        d
        for d in (cuda(f) for f in range(free // 2, 4 * free, 1000))
        if 5 * per_slot <= gpu_room(v, mx.bfloat16, d, 1, 16) < 6 * per_slot
    )
    some = plan_ring(
        v, requested="auto", dtype=mx.bfloat16, device=device, max_batch=1, max_context=16
    )
    assert some.slots == 5


def test_impossible_gpu_budgets_name_the_fix(vaults):
    v = vaults["bf16"]
    tiny = cuda(v.backbone_path.stat().st_size)  # the backbone leaves no room
    with pytest.raises(SmoeError, match="less than one layer's top-2.*--device cpu"):
        plan_ring(v, requested="auto", dtype=mx.bfloat16, device=tiny)
    per_slot = plan_ring(v, requested="auto", dtype=mx.bfloat16, device=cuda(10**12)).slot_bytes
    some = next(
        d
        for d in (cuda(free) for free in range(10**5, 10**8, 1000))
        if 3 * per_slot <= gpu_room(v, mx.bfloat16, d, 8, None) <= 5 * per_slot
    )
    # --memory is the whole process's budget: the GPU's room is named as a whole budget too
    needs = plan_module.budget_parts(v, mx.bfloat16, kind="staged", discrete=True)
    with pytest.raises(SmoeError, match=r"does not fit this GPU.*--memory \d+[KM]B or less"):
        plan_ring(
            v, requested="auto", dtype=mx.bfloat16, device=some, memory=needs.fixed + 10 * per_slot
        )
    big = cuda(10**12)
    with pytest.raises(SmoeError, match="below one token's top-2"):
        plan_ring(v, requested="auto", dtype=mx.bfloat16, device=big, slots=1)


def test_suggested_sizes_never_exceed_the_room():
    from smoe.util.sizes import parse_size, round_size

    for n in (999, 1000, 12_345_678, 4_290_000_000, 10**12 + 7):
        assert 0 < parse_size(round_size(n, up=False)) <= n


def test_kv_room_counts_every_sequence_of_the_context(vaults):
    v = vaults["bf16"]
    cfg = v.config()
    one = plan_module.kv_room(cfg, mx.bfloat16, 1, 100)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg["num_key_value_heads"]
    # mlx-lm's caches grow in steps of 256 tokens: 100 tokens take 256 (tests/test_budget.py)
    assert one == 256 * 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 2
    assert plan_module.kv_room(cfg, mx.bfloat16, 8, 100) == 8 * one


@pytest.mark.asyncio
async def test_the_engine_builds_the_planned_ring(vaults):
    async with Engine.open(vaults["bf16"].path, slots=3) as engine:
        assert engine.debug.ring.kind == "staged" and engine.stats().ring.slots == 3
    async with Engine.open(vaults["f32"].path, slots=3) as engine:
        assert engine.debug.ring.kind == "unified"
    engine = Engine.open(vaults["bf16"].path, ring="unified")
    with pytest.raises(SmoeError, match="--ring staged"):
        await engine.__aenter__()
    await engine.aclose()


def test_a_cuda_gpus_free_memory_counts_mlxs_cache_of_freed_buffers(monkeypatch):
    """A closed engine's ring sits in MLX's buffer cache until cleared; this process reuses
    it, so it is free memory to the next engine (controlled fakes of MLX's device queries:
    found on the H200, where a third engine in one process saw 9.45 GB 'free')."""
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    monkeypatch.setattr(mx, "device_info", lambda device: {"free_memory": 9 * 10**9})
    monkeypatch.setattr(mx, "get_cache_memory", lambda: 120 * 10**9)
    device = plan_module.current_device(mx.gpu)
    assert device.discrete and device.free_memory == 129 * 10**9
    assert plan_module.current_device(mx.cpu) == Device(gpu=False, discrete=False)


@pytest.mark.asyncio(loop_factories=["uvloop"])  # allocator state, not loop behaviour
async def test_a_closed_engine_gives_its_cached_buffers_back(vaults):
    async with Engine.open(vaults["f32"].path, slots=4) as engine:
        await engine.logits([5, 6, 7, 8])
        assert mx.get_cache_memory() > 0  # freed activations kept for the next pass
    assert mx.get_cache_memory() == 0


@pytest.mark.asyncio(loop_factories=["uvloop"])  # allocator state, not loop behaviour
async def test_a_closed_engine_frees_its_staged_ring_while_still_referenced(vaults):
    """The staged ring's banks (on a CUDA GPU: device memory) go when the engine closes,
    not when the caller's last reference to it does: a script that opens a second engine
    after the first one's `async with` gets the memory back (tests/test_gpu.py, on CUDA)."""
    mx.clear_cache()
    before = mx.get_active_memory()
    slots = vaults["bf16"].manifest.num_records  # every expert: the ring dominates
    engine = Engine.open(vaults["bf16"].path, ring="staged", slots=slots)
    async with engine:
        await engine.logits([5, 6, 7, 8])
        ring_bytes = engine.stats().ring.nbytes
        assert mx.get_active_memory() - before >= ring_bytes
        ring = engine.debug.ring  # a reference that outlives the engine's
    assert ring.banks() == [] and engine.debug.ring is None
    assert mx.get_active_memory() - before < ring_bytes // 4  # the backbone went too


def test_every_device_batches_and_a_gpu_gets_its_kernel_rules():
    """A batched pass is exact where each row gets its solo bits: on the CPU always, on a
    GPU through the kernel rules (smoe.compute.solo_rows), so every device batches 8 by
    default; CUDA gets its measured rules, another GPU solo call shapes, the CPU none
    unless forced (the CPU tests force them)."""
    from smoe.compute.solo_rows import CUDA, SOLO_SHAPES
    from smoe.plan.ring import CPU_BATCH, Device, batch_size, kernel_rules

    cpu, cuda, metal = (
        Device(gpu=False, discrete=False),
        Device(gpu=True, discrete=True),
        Device(gpu=True, discrete=False),
    )
    for device in (cpu, cuda, metal):
        assert batch_size(None, device) == CPU_BATCH == 8 and batch_size(3, device) == 3
    assert kernel_rules(cpu, None) is None and kernel_rules(cpu, True) is CUDA
    assert kernel_rules(cuda, None) is CUDA and kernel_rules(cuda, False) is None
    assert kernel_rules(metal, None) is SOLO_SHAPES
