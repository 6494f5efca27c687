"""One memory budget for the whole process (smoe.plan.budget): each part against what
MLX and mlx-lm actually allocate, the ring sized from what remains, and a budget too
small refused before anything loads."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from smoe.compute.model import float_policy
from smoe.engine import Engine
from smoe.errors import SmoeError
from smoe.models.checkpoint import safetensors_header
from smoe.plan.budget import Attention, backbone_bytes, default_contexts, kv_bytes
from smoe.plan.ring import Device, budget_parts, plan_ring
from tests.conftest import tiny_vault

REPO = Path(__file__).resolve().parents[2]
CPU_DEVICE = Device(gpu=False, discrete=False)


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    return tiny_vault(tmp_path_factory.mktemp("budget"), seed=17)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backbone_bytes_equal_the_loaded_arrays(vault, dtype):
    """The header-only count equals the nbytes of the backbone the engine loads, its float
    tensors cast to the compute dtype."""
    from smoe.compute.model import resident_model

    model = resident_model(vault, getattr(mx, dtype))
    prefixes = tuple(spec.module + "." for spec in vault.manifest.layers)
    loaded = sum(
        a.nbytes for name, a in tree_flatten(model.parameters()) if not name.startswith(prefixes)
    )
    header = safetensors_header(vault.backbone_path)
    assert backbone_bytes(header, float_policy(vault, getattr(mx, dtype))) == loaded


@pytest.mark.parametrize("tokens", [1, 200, 300])
def test_kv_bytes_equal_mlx_lm_caches_after_the_model_ran(vault, tokens):
    """mlx-lm's own KVCache per layer, after ``tokens`` tokens through the model, holds
    exactly what kv_bytes counts (its 256-token steps included)."""
    from mlx_lm.models.cache import KVCache

    from smoe.compute.model import resident_model

    model = resident_model(vault, mx.float32)
    caches = [KVCache() for _ in model.layers]
    model(mx.array([[10 + i % 100 for i in range(tokens)]]), cache=caches)
    mx.eval([c.state for c in caches])
    attn = Attention.of(vault.config())
    assert sum(c.nbytes for c in caches) == kv_bytes(attn, 4, tokens, 1, None)
    assert kv_bytes(attn, 4, tokens, 3) == 3 * kv_bytes(attn, 4, tokens, 1)


@pytest.mark.parametrize("bits", [None, 8, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_bytes_equal_mlx_lm_quantized_caches(bits, dtype):
    """mlx-lm's QuantizedKVCache (group 64) fed 64-token chunks then single tokens, as the
    engine feeds it, holds what kv_bytes counts (head_dim 128: the tiny test models' 16
    cannot be quantized in groups of 64)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    attn = Attention(
        layers=3,
        heads=8,
        kv_heads=2,
        head_dim=128,
        hidden=256,
        vocab=100,
        intermediate=64,
        max_context=4096,
    )
    dt = getattr(mx, dtype)
    caches = [KVCache() if bits is None else QuantizedKVCache(64, bits) for _ in range(3)]
    fed = 0
    for n in [64] * 5 + [1] * 3:
        for c in caches:
            k = mx.random.normal((1, attn.kv_heads, n, attn.head_dim)).astype(dt)
            c.update_and_fetch(k, k)
        fed += n
        mx.eval([c.state for c in caches])
        assert sum(c.nbytes for c in caches) == kv_bytes(attn, dt.size, fed, 1, bits)


def test_quantized_kv_bytes_follow_mlx_lm_layout(vault):
    """8 bits: a byte per element plus a float32 scale and bias per group (64, or 32 for
    heads 32 wide); heads 16 wide cannot be quantized (the tiny vault's): refused."""
    config = {**vault.config(), "head_dim": 32}
    attn = Attention.of(config)
    assert attn.kv_group == 32
    elements = 2 * attn.layers * attn.kv_heads * 32 * 256
    assert kv_bytes(attn, 4, 256, 1, None) == 4 * elements
    assert kv_bytes(attn, 4, 256, 1, 8) == elements + elements // 32 * 8
    assert kv_bytes(attn, 4, 256, 1, 4) == elements // 2 + elements // 32 * 8
    with pytest.raises(SmoeError, match="kv_bits must be 4 or 8"):
        kv_bytes(attn, 4, 256, 1, 3)
    with pytest.raises(SmoeError, match="multiple of 32; this model's are 16 wide"):
        kv_bytes(Attention.of(vault.config()), 4, 256, 1, 8)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_mla_kv_bytes_are_what_deepseek_caches(tmp_path, arch):
    """DeepSeek-V2's mlx-lm file caches per head keys of nope+rope and values of v_head_dim,
    V3's its latent and one rope key: kv_bytes equals their caches' bytes after a prompt."""
    from mlx_lm.models.cache import make_prompt_cache

    from smoe.compute.model import resident_model
    from smoe.vault.convert import convert
    from tests.conftest import make_hf_checkpoint

    src = make_hf_checkpoint(tmp_path / "src", arch, seed=2)
    v = convert(src, tmp_path / "v")
    model = resident_model(v, mx.float32)
    cache = make_prompt_cache(model)
    model(mx.array([[5 + i for i in range(70)]]), cache=cache)
    mx.eval([c.state for c in cache])
    assert sum(c.nbytes for c in cache) == kv_bytes(Attention.of(v.config()), 4, 70)


def _needs(vault, **kw):
    """The parts an engine budgets by default (budget.pick_context: DEFAULT_CONTEXT)."""
    kw.setdefault("max_context", default_context(vault))
    return budget_parts(vault, mx.float32, kind="unified", **kw)


def default_context(vault) -> int:
    return default_contexts(Attention.of(vault.config()).max_context)[0]


@pytest.mark.asyncio
async def test_the_ring_gets_what_the_whole_budget_leaves(vault):
    m = vault.manifest
    needs = _needs(vault, max_batch=1)
    stride = m.record.stride
    memory = needs.fixed + 5 * stride + stride // 2
    async with Engine.open(vault.path, memory=memory, max_batch=1) as engine:
        assert engine.stats().ring.slots == 5
        assert engine.plan.ring.fit is not None and engine.plan.ring.fit.slots == 5
        assert engine.plan.ring.fit.fixed == needs.fixed and engine.plan.ring.fit.total == memory
        assert (
            "-> ring" in engine.plan.ring.fit.line() and "5 experts" in engine.plan.ring.fit.line()
        )
    # KV for 8 sequences comes out of the budget too (8 rows of logits in working memory)
    needs8 = _needs(vault, max_batch=8)
    assert needs8.kv == 8 * needs.kv and needs8.working > needs.working
    plan8 = plan_ring(
        vault,
        requested="auto",
        dtype=mx.float32,
        device=CPU_DEVICE,
        memory=needs8.fixed + 7 * stride,
        max_context=default_context(vault),
    )  # max_batch 8: the engine's default
    assert plan8.fit is not None and plan8.slots == 7 and plan8.fit.kv == needs8.kv
    # --slots stays the explicit override (no budget division)
    async with Engine.open(vault.path, slots=3, memory=1) as engine:
        assert engine.stats().ring.slots == 3 and engine.plan.ring.fit is None


@pytest.mark.asyncio
async def test_mlx_keeps_no_more_freed_buffers_than_the_budget_counts(vault):
    """Issue 49: working memory counts (ALLOCATOR_SLACK - 1) x a pass's transient bytes
    for the freed buffers MLX's cache keeps; MLX's own cap on the CPU is 32 MB, whatever
    that is. Under --memory the engine caps MLX's cache at the plan's figure while it is
    open (what it holds after a prompt and a decode stays within it), and puts the
    caller's limit back when it closes."""
    from smoe.plan.budget import ALLOCATOR_SLACK, allocator_cache_bytes, transient_bytes

    needs = _needs(vault, max_batch=1)
    attn, context = Attention.of(vault.config()), default_context(vault)
    transient = transient_bytes(attn, 4, 64, context, 1)
    assert needs.cache == allocator_cache_bytes(attn, 4, 64, context, 1) > 0
    assert needs.cache == int((ALLOCATOR_SLACK - 1) * transient)
    memory = needs.fixed + 5 * vault.manifest.record.stride
    callers = mx.set_cache_limit(123_456_789)
    try:
        async with Engine.open(vault.path, memory=memory, max_batch=1) as engine:
            assert engine.plan.ring.fit is not None and engine.plan.ring.fit.cache == needs.cache
            assert engine.plan.ring.fit.to_json()["allocator_cache_bytes"] == needs.cache
            assert mx.set_cache_limit(needs.cache) == needs.cache  # capped at the plan's
            await engine.logits(list(range(5, 200)))
            async for _ in engine.generate([5, 6, 7], max_tokens=4):
                pass
            assert 0 < mx.get_cache_memory() <= needs.cache
        assert mx.set_cache_limit(123_456_789) == 123_456_789  # the caller's, back
        async with Engine.open(vault.path, slots=5, max_batch=1):  # no budget: untouched
            assert mx.set_cache_limit(123_456_789) == 123_456_789
    finally:
        mx.set_cache_limit(callers)


def test_the_smallest_budget_works_and_one_byte_less_is_refused(vault):
    m = vault.manifest
    top_k = m.shape.experts_per_token
    needs = _needs(vault, max_batch=1)
    smallest = needs.fixed + top_k * m.record.stride
    fit = plan_ring(
        vault,
        requested="auto",
        dtype=mx.float32,
        device=CPU_DEVICE,
        memory=smallest,
        max_batch=1,
        max_context=default_context(vault),
    ).fit
    assert fit is not None and fit.slots == top_k
    with pytest.raises(SmoeError, match=r"smallest that works is --memory \d+MB"):
        plan_ring(
            vault,
            requested="auto",
            dtype=mx.float32,
            device=CPU_DEVICE,
            memory=smallest - 1,
            max_batch=1,
            max_context=default_context(vault),
        )
    # a shorter context or an 8-bit cache shrinks the KV part (and so the smallest budget)
    assert _needs(vault, max_batch=1, max_context=256).kv < needs.kv
    wide = {**vault.config(), "head_dim": 32}
    assert kv_bytes(Attention.of(wide), 4, 4096, 1, 8) < kv_bytes(Attention.of(wide), 4, 4096)


def _open_files() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
    return out


@pytest.mark.asyncio
async def test_an_impossible_budget_is_refused_before_anything_loads(vault):
    threads = threading.active_count()
    engine = Engine.open(vault.path, memory="50MB")
    with pytest.raises(SmoeError, match=r"smallest that works is --memory \d+MB") as info:
        await engine.__aenter__()
    assert "\n" not in str(info.value)
    assert threading.active_count() == threads  # no compute thread, no I/O workers
    assert not any(p.endswith(("experts.bin", "backbone.safetensors")) for p in _open_files())
    assert engine.debug.compute is None and engine.debug.ring is None
    await engine.aclose()


def test_the_cli_refuses_with_one_line_naming_the_smallest(vault):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "smoe.cli",
            "generate",
            str(vault.path),
            "--prompt-ids",
            "5,6",
            "--memory",
            "50MB",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 1, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert "smoe generate: error: a memory budget of 50MB" in lines[0]
    assert "smallest that works is --memory" in lines[0]


@pytest.mark.parametrize(("context", "prompt_tokens"), [(512, 300), (4096, 4000)])
def test_a_generation_stays_within_its_budget(vault, context, prompt_tokens):
    """Peak RSS of a whole `smoe generate` process (a long prompt: a layer-major prefill
    pass over all of it, KV, the ring) stays within the --memory the budget accepted, the
    smallest one included, with the context budgeted tight (its attention scores are
    those of a full cache)."""
    needs = _needs(vault, max_batch=1, max_context=context)
    smallest = needs.fixed + vault.manifest.shape.experts_per_token * vault.manifest.record.stride
    # VmHWM: this process's own peak (ru_maxrss would carry the forking pytest's across exec)
    code = (
        "import sys\n"
        "from smoe.cli import main\n"
        "rc = main(sys.argv[1:])\n"
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
        "print('PEAK', int(hwm.split()[1]) * 1024)\n"
        "sys.exit(rc)\n"
    )
    prompt = ",".join(str(10 + i % 200) for i in range(prompt_tokens))
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "generate",
            str(vault.path),
            "--prompt-ids",
            prompt,
            "--max-tokens",
            "8",
            "--max-context",
            str(context),
            "--memory",
            str(smallest),
            "--json",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 0, r.stderr
    peak = int(r.stdout.split("PEAK")[-1])
    assert "memory " in r.stderr and "-> ring" in r.stderr  # the engine said how it divided
    assert peak <= smallest, f"peak RSS {peak} above the budget {smallest}"


@pytest.mark.asyncio
async def test_the_default_context_is_4096_and_halves_to_fit_the_budget(vault):
    """Without --max-context the KV caches are budgeted for DEFAULT_CONTEXT tokens (the
    tiny model allows 32,768), named as the default in the line; a budget too small for
    it gets the largest half that fits; one too small even for 512 tokens is refused,
    naming the smallest budget that works there."""
    m = vault.manifest
    top_k, stride = m.shape.experts_per_token, m.record.stride

    def smallest(context: int) -> int:
        return _needs(vault, max_batch=1, max_context=context).fixed + top_k * stride

    assert Attention.of(vault.config()).max_context == 32768
    async with Engine.open(vault.path, memory=smallest(4096) + stride, max_batch=1) as e:
        assert (
            e.max_context == 4096
            and e.plan.ring.fit is not None
            and e.plan.ring.fit.context == 4096
        )
        assert "4096 context by default" in e.plan.ring.fit.line()
    async with Engine.open(vault.path, memory=smallest(1024), max_batch=1) as e:
        assert (
            e.max_context == 1024 and e.plan.ring.fit is not None and e.plan.ring.fit.slots == top_k
        )
    with pytest.raises(SmoeError, match=r"1 x 512 context.*smallest that works is --memory"):
        async with Engine.open(vault.path, memory=smallest(512) - 1, max_batch=1):
            pass
    async with Engine.open(vault.path, memory=smallest(4096), max_context=300) as e:
        assert e.max_context == 300 and "by default" not in e.plan.ring.fit.line()
    async with Engine.open(vault.path) as e:  # no --memory: the default context too
        assert e.max_context == 4096
