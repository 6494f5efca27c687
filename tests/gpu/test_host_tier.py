"""On a CUDA GPU: the host tier between the GPU's ring and the vault (smoe.io.host_tier).
Greedy tokens equal mlx-lm's in GPU memory at (ring, host tier) = (min, 0), (min, 50%),
(5%, 100%), (25%, 25%) of the experts, for 4- and 16-bit vaults of two architectures;
batched and drafted requests get their solo tokens through the tier. SMOE_GPU_TIER_ARCHS /
SMOE_GPU_TIER_BITS (comma lists) pick a subset; SMOE_GPU_REPORT gets a JSON line per cell."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from smoe.engine import Engine
from smoe.io.host_tier import image_layout
from tests.gpu.gpu_common import (
    CUDA,
    ENGINE,
    GPU_MARKS,
    STEPS,
    first_difference,
    generate,
    reference,
    report,
)

pytestmark = GPU_MARKS
ARCHS = os.environ.get("SMOE_GPU_TIER_ARCHS", "qwen3_moe,gpt_oss").split(",")
BITS = [int(b) for b in os.environ.get("SMOE_GPU_TIER_BITS", "4,16").split(",")]
CELLS = [("min", 0.0), ("min", 0.5), (0.05, 1.0), (0.25, 0.25)]


def ring_slots(vault, share: str | float) -> int:
    top_k = vault.manifest.shape.experts_per_token
    return top_k if share == "min" else max(top_k, round(float(share) * vault.manifest.num_records))


@pytest.mark.asyncio(loop_factories=["uvloop"])  # the loop smoe runs on; GPU time is scarce
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("arch", ARCHS)
async def test_every_pair_of_sizes_gives_mlx_lms_tokens_on_the_gpu(arch, bits, models):
    import mlx.core as mx

    if bits == 16 and not CUDA:
        pytest.skip("MLX's CPU gather_mm computes float32 only")
    vault, model = models(arch, bits)
    m = vault.manifest
    top = min(4000, int(vault.config()["vocab_size"]))
    prompts = [
        np.random.default_rng(60 + i).integers(10, top, 9 + 25 * i).tolist() for i in range(3)
    ]
    want = [reference(model, p, STEPS)[0] for p in prompts]
    image = image_layout(m.record, getattr(mx, ENGINE["dtype"]))[1]
    wrong = []
    for ring_share, host_share in CELLS:
        slots = ring_slots(vault, ring_share)
        host = round(host_share * m.num_records) * image
        async with Engine.open(vault.path, slots=slots, host_memory=host, **ENGINE) as engine:
            got = [await generate(engine, p, STEPS) for p in prompts]
            async with engine.exclusive():  # the three at once: batched through the tier
                runs = [asyncio.ensure_future(generate(engine, p, STEPS)) for p in prompts]
                await asyncio.sleep(0)
            together = await asyncio.gather(*runs)
            tier = engine.stats().host_tier
        cell = {
            "test": "host tier",
            "arch": arch,
            "bits": bits,
            "ring_slots": slots,
            "host_images": tier.images,
            "tier_hits": tier.hits,
            "demoted": tier.demoted,
            "solo_equal": sum(g == w for g, w in zip(got, want, strict=True)),
            "batched_equal": sum(g == w for g, w in zip(together, want, strict=True)),
            "first_differences": [first_difference(g, w) for g, w in zip(got, want, strict=True)],
        }
        report(cell)
        if got != want or together != want:
            wrong.append(cell)
    assert not wrong, wrong  # every cell is run and reported first


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_drafted_requests_get_their_tokens_through_the_tier(models):
    """Prompt-lookup drafts verified in one pass (docs/draft.md) at the smallest ring with
    a tier of half the experts: mlx-lm's greedy tokens."""
    import mlx.core as mx

    vault, model = models("qwen3_moe", 4)
    m = vault.manifest
    base = np.random.default_rng(71).integers(10, 4000, 24).tolist()
    prompt = base + base + base[:8]  # repeats: drafts get proposed and accepted
    want = reference(model, prompt, STEPS)[0]
    image = image_layout(m.record, getattr(mx, ENGINE["dtype"]))[1]
    async with Engine.open(
        vault.path,
        slots=ring_slots(vault, "min"),
        host_memory=m.num_records // 2 * image,
        draft="ngram",
        **ENGINE,
    ) as engine:
        got = await generate(engine, prompt, STEPS)
        tier = engine.stats().host_tier
    report({"test": "host tier, drafts", "equal": got == want, "tier_hits": tier.hits})
    assert got == want and tier.hits > 0
