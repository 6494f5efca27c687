"""The host tier between a staged ring and the vault (smoe.io.host_tier): mlx-lm's greedy
tokens at every pair of sizes (ring, host tier), alone and batched, and the vault read
only once where the tier holds everything the ring does not.

On the CPU a staged ring is what a GPU gets (slots in their own arrays, landings
committed, slots copied out on eviction); the bits of the copies do not depend on the
device, the kernels' are held on the GPU by tests/gpu/test_host_tier.py."""

from __future__ import annotations

import asyncio

import pytest

from smoe.engine import Engine
from smoe.vault.convert import ConvertOptions, convert
from tests.exact.test_engine_exact import (
    _prompt,
    engine_generate,
    reference_decode,
    reference_model,
    top_k_of,
)

pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])  # arithmetic, not loop behaviour
STEPS = 64


@pytest.fixture(scope="module")
def vaults(hf_dir, tmp_path_factory):
    """Factory: (vault, mlx-lm reference) per (arch, bits), converted once."""
    cache: dict = {}

    def get(arch: str, bits: int):
        if (arch, bits) not in cache:
            root = tmp_path_factory.mktemp(f"tier-{arch}-{bits}")
            vault = convert(hf_dir(arch), root / "v", ConvertOptions(bits=bits, dtype="float32"))
            cache[arch, bits] = (vault, reference_model(vault, root / "mlx"))
        return cache[arch, bits]

    return get


CELLS = [(0.0, 0.0), (0.0, 0.5), (0.05, 1.0), (0.25, 0.25)]  # (ring, host): the issue's


@pytest.mark.parametrize("bits", [4, 16])
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
async def test_every_pair_of_sizes_gives_mlx_lms_tokens(arch, bits, vaults):
    vault, ref = vaults(arch, bits)
    prompt = _prompt(70, seed=5)
    want, _ = reference_decode(ref, prompt, STEPS)
    n = vault.manifest.num_records
    async with Engine.open(vault.path, ring="staged", slots=top_k_of(vault)) as probe:
        image = probe.stats().ring.slot_bytes  # an image holds one slot's form
    for ring_share, host_share in CELLS:
        slots = max(top_k_of(vault), round(ring_share * n))
        host = round(host_share * n) * image
        async with Engine.open(vault.path, ring="staged", slots=slots, host_memory=host) as engine:
            got = await engine_generate(engine, prompt, STEPS, stop_at_eos=False)
            tier = engine.stats().host_tier
            if engine.debug.host_tier is not None:
                engine.debug.host_tier.check_invariants()
        assert got == want, (ring_share, host_share)
        assert tier.images == (round(host_share * n) if slots < n else 0)
        if host_share and slots < n:
            assert tier.hits > 0, (ring_share, host_share)  # the tier served misses


async def test_batched_requests_get_their_solo_tokens_through_the_tier(vaults):
    vault, ref = vaults("qwen3_moe", 4)
    prompts = [_prompt(20 + 9 * i, seed=30 + i) for i in range(3)]
    want = [reference_decode(ref, p, 24)[0] for p in prompts]
    slots = 2 * top_k_of(vault)
    async with Engine.open(vault.path, ring="staged", slots=slots) as probe:
        image = probe.stats().ring.slot_bytes
    half = vault.manifest.num_records // 2 * image
    async with Engine.open(vault.path, ring="staged", slots=slots, host_memory=half) as engine:
        async with engine.exclusive():  # all three queued before the first is admitted
            runs = [
                asyncio.ensure_future(engine_generate(engine, p, 24, stop_at_eos=False))
                for p in prompts
            ]
            await asyncio.sleep(0)
        got = await asyncio.gather(*runs)
        assert engine.stats().batch.steps > 0 and engine.stats().host_tier.hits > 0
    assert got == want


async def test_a_tier_holding_every_expert_reads_each_from_the_vault_once(vaults):
    """Ring of top-k, tier of the rest: every record is read from the disk once (the
    compulsory misses); every later miss is a copy up."""
    vault, _ = vaults("qwen3_moe", 4)
    m = vault.manifest
    async with Engine.open(vault.path, ring="staged", slots=top_k_of(vault)) as probe:
        image = probe.stats().ring.slot_bytes
    async with Engine.open(
        vault.path, ring="staged", slots=top_k_of(vault), host_memory=m.num_records * image
    ) as engine:
        for seed in range(3):
            await engine_generate(engine, _prompt(40, seed=seed), 16, stop_at_eos=False)
        stats = engine.stats()
    assert stats.scheduler.bytes_read() <= m.num_records * m.record.stride
    assert stats.host_tier.hits > 0 and stats.host_tier.dropped == 0
