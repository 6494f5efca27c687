"""``kv_bits``: the quantized KV cache is mlx-lm's own, and its tokens are mlx-lm's.

The reference is mlx-lm's ``generate_step`` with ``kv_bits`` on the vault exported as an
mlx-lm model (heads 64 wide: mlx-lm's default group of 64), quantizing from the first token (``quantized_kv_start=0``) and
prefilling in the engine's 64-token chunks: the conversion points are then the same, so
the arithmetic is too. The prompt spans three chunks, the model is random (near-uniform
logits), so a cache rounded another way, or not at all, changes the tokens: the test
checks that it does for mlx-lm itself before it trusts the comparison.
"""

from __future__ import annotations

import asyncio
import json

import mlx.core as mx
import numpy as np
import pytest

from smoe.engine import Engine
from smoe.errors import SmoeError
from smoe.vault.convert import convert
from smoe.vault.format import Vault
from tests.conftest import make_hf_checkpoint
from tests.exact.test_engine_exact import reference_model

PROMPT = np.random.default_rng(11).integers(2, 256, 150).tolist()  # chunks of 64, 64, 21
STEPS = 24


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv")
    src = make_hf_checkpoint(root / "src", "qwen3_moe", seed=3, head_dim=64)
    return convert(src, root / "v").path


@pytest.fixture(scope="module")
def model(vault, tmp_path_factory):
    """mlx-lm's in-memory model of the vault, in the engine's float32."""
    return reference_model(Vault.open(vault), tmp_path_factory.mktemp("kv") / "export")


def mlx_lm_steps(model, bits):
    """mlx-lm's greedy (token, logprobs) per step with ``kv_bits=bits``."""
    from mlx_lm.generate import generate_step

    steps = generate_step(
        mx.array(PROMPT),
        model,
        max_tokens=STEPS,
        kv_bits=bits,
        kv_group_size=64,
        quantized_kv_start=0,
        prefill_step_size=64,
    )
    return [(int(t), np.array(lp)) for t, lp in steps]


@pytest.fixture(scope="module")
def mlx_lm_tokens(model):
    """mlx-lm's greedy tokens per kv_bits (None: its float cache)."""
    return {bits: [t for t, _ in mlx_lm_steps(model, bits)] for bits in (None, 8, 4)}


async def _generate(engine, prompt=PROMPT):
    tokens = []
    async for ev in engine.generate(prompt, max_tokens=STEPS, temperature=0.0, stop_at_eos=False):
        if ev.token is not None:
            tokens.append(ev.token)
    return tokens


def engine_tokens(vault, **options):
    async def run():
        async with Engine.open(vault, **options) as engine:
            return await _generate(engine)

    return asyncio.run(run())


def test_the_reference_sees_the_rounding(mlx_lm_tokens):
    """Guard: on this model 4-bit rounding changes mlx-lm's greedy tokens, so the engine's
    equality with them below cannot come from a float cache (8-bit rounding changes the
    logits only: the next test compares those)."""
    assert mlx_lm_tokens[4] != mlx_lm_tokens[None]


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_runner_logprobs_equal_generate_step_bit_for_bit(model, bits):
    """The runner's quantization points are mlx-lm's: every step's log-probabilities on
    the in-memory model are generate_step's, bit for bit (and 8 bits differ from none)."""
    from smoe.compute.runner import Runner
    from smoe.sampling import SamplingParams

    runner = Runner(model, kv_bits=bits)
    seq = runner.start(PROMPT, SamplingParams())
    mine = []
    for _ in range(STEPS):
        logits = mx.array(runner.next_logits(seq))
        mine.append(np.array(logits - mx.logsumexp(logits, keepdims=True)))
        seq.tokens.append(int(np.argmax(mine[-1])))
    want = mlx_lm_steps(model, bits)
    assert [int(np.argmax(lp)) for lp in mine] == [t for t, _ in want]
    for step, (lp, (_, ref)) in enumerate(zip(mine, want, strict=True)):
        assert np.array_equal(lp, ref), (bits, step, np.abs(lp - ref).max())
    if bits == 8:
        assert not np.array_equal(mine[-1], mlx_lm_steps(model, None)[-1][1])


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("slots", [4, None])  # a ring of 4 of 16 experts, and all of them
def test_tokens_equal_mlx_lm_with_the_same_kv_bits(vault, mlx_lm_tokens, bits, slots):
    assert engine_tokens(vault, kv_bits=bits, slots=slots) == mlx_lm_tokens[bits]


def test_no_kv_bits_is_the_float_cache(vault, mlx_lm_tokens):
    assert engine_tokens(vault) == mlx_lm_tokens[None]


def test_batched_decode_is_each_request_alone(vault, mlx_lm_tokens):
    """Two requests decoded together (per-row attention on quantized caches) get the tokens
    each gets alone; a prompt sharing the first's prefix reuses nothing it should not."""

    async def run():
        async with Engine.open(vault, kv_bits=4, max_batch=2) as engine:
            other = PROMPT[:100]
            both = await asyncio.gather(_generate(engine), _generate(engine, other))
            alone = await _generate(engine, other)
            return both, alone

    (first, second), alone = asyncio.run(run())
    assert first == mlx_lm_tokens[4]
    assert second == alone


def test_quantized_cache_is_smaller(model):
    """What the option is for, measured on the runner's own caches after a 150-token
    prompt: float32 keys and values -> 8 or 4 bits plus a float32 scale and bias per 64."""
    from smoe.compute.runner import Runner
    from smoe.sampling import SamplingParams

    def nbytes(bits):
        seq = Runner(model, kv_bits=bits).start(PROMPT, SamplingParams())
        return sum(c.nbytes for c in seq.cache)

    full, eight, four = nbytes(None), nbytes(8), nbytes(4)
    assert eight / full == pytest.approx((8 / 32 + 2 / 64) / 1, rel=0.01)
    assert four / full == pytest.approx((4 / 32 + 2 / 64) / 1, rel=0.01)


def test_stats_report_the_kv_cache(vault):
    """GenerationStats.kv_cache_bytes: what the request's cache took, 8 bits < float."""

    async def run(bits):
        async with Engine.open(vault, kv_bits=bits) as engine:
            async for ev in engine.generate(PROMPT, max_tokens=2, temperature=0.0):
                if ev.stats is not None:
                    return ev.stats.kv_cache_bytes

    full, eight = asyncio.run(run(None)), asyncio.run(run(8))
    assert eight / full == pytest.approx(8 / 32 + 2 / 64, rel=0.01)


def test_conversation_saved_with_other_kv_bits_is_refused(tmp_path, monkeypatch):
    """On the demo model (a chat template; heads 32 wide: groups of 32)."""
    from smoe.chat.demo import demo_vault

    monkeypatch.setenv("SMOE_CACHE", str(tmp_path / "cache"))  # not the user's cache
    vault = demo_vault()

    async def run():
        async with Engine.open(vault, kv_bits=8) as engine:
            conv = engine.conversation()
            async for _ in conv.send("In the beginning", max_tokens=2):
                pass
            path = await conv.save(tmp_path / "chat")
        async with Engine.open(vault) as engine:
            with pytest.raises(SmoeError, match="--kv-bits 8"):
                await engine.load_conversation(path)
        async with Engine.open(vault, kv_bits=8) as engine:
            loaded = await engine.load_conversation(path)
            return json.dumps(loaded.messages)

    assert "In the beginning" in asyncio.run(run())


def test_bad_kv_bits_refused_before_anything_opens(vault):
    with pytest.raises(SmoeError, match="kv_bits must be 4 or 8"):
        engine_tokens(vault, kv_bits=3)


def test_sliding_window_models_refuse_kv_bits():
    """mlx-lm cannot quantize a RotatingKVCache: the runner says so instead of failing in
    the middle of a generation."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from smoe.compute.runner import Runner

    class Model:
        layers = [object(), object()]

        def make_cache(self):
            return [KVCache(), RotatingKVCache(max_size=16)]

    with pytest.raises(SmoeError, match="RotatingKVCache.*leave --kv-bits out"):
        Runner(Model(), kv_bits=8)
    Runner(Model())  # fine without


@pytest.mark.parametrize("bits", [8, 4])
def test_greedy_drafts_over_a_quantized_cache_are_plain_greedy_tokens(model, bits):
    """--kv-bits with --draft: a verify pass writes k+1 quantized positions and trims the
    rejected ones; its tokens are plain decoding's over the same quantized cache."""
    from smoe.compute.draft import DraftGovernor, Drafting
    from smoe.compute.runner import Runner
    from smoe.sampling import SamplingParams

    loop = [5, 9, 31, 7, 64, 2, 17, 88, 40, 3] * 3  # a prompt to look drafts up in
    plain = Runner(model, kv_bits=bits, kv_group_size=64)
    seq = plain.start(loop, SamplingParams())
    want = [plain.step(seq) for _ in range(40)]
    never_off = lambda: DraftGovernor(min_passes=10**9)  # noqa: E731  (no wall-clock judgement)
    drafting = Drafting(tokens=4, governor=never_off)
    runner = Runner(model, kv_bits=bits, kv_group_size=64, drafting=drafting)
    seq = runner.start(loop, SamplingParams())
    got: list[int] = []
    while len(got) < 40:
        got += runner.step_draft(seq, 40 - len(got))
    assert got == want
    assert type(seq.cache[0]).__name__ == "QuantizedKVCache" and seq.cache[0].bits == bits
    stats = runner.drafting.stats
    assert stats.verify_passes > 0 and stats.accepted > 0


def test_a_cuda_gpu_refuses_kv_bits_in_one_line():
    """MLX's CUDA backend cannot run attention over a quantized cache (tests/test_gpu.py
    shows mlx-lm failing there); Apple's unified GPU and the CPU can."""
    from smoe.plan.ring import Device, check_kv_bits

    check_kv_bits(8, Device(gpu=False, discrete=False))
    check_kv_bits(4, Device(gpu=True, discrete=False))
    check_kv_bits(None, Device(gpu=True, discrete=True))
    with pytest.raises(SmoeError, match="--kv-bits does not run on a CUDA GPU"):
        check_kv_bits(8, Device(gpu=True, discrete=True))
