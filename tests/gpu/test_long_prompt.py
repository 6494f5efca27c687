"""On a CUDA GPU: layer-major prefill of long prompts (smoe.compute.prompt_pass) gives
mlx-lm's tokens and logits in memory, fed the same 64-token chunks, at the smallest ring
(layers in waves), a quarter of the experts and all of them: tests/exact/test_prompt_pass.py's
cells on the GPU's kernels at its default dtype (the bytes, which no kernel changes, are
held there). SMOE_GPU_LONG_ARCHS / SMOE_GPU_LONG_BITS / SMOE_GPU_LONG_LENGTHS (comma lists)
pick a subset; SMOE_GPU_REPORT gets a JSON line per cell."""

from __future__ import annotations

import os

import numpy as np
import pytest

from smoe.engine import Engine
from tests.exact.test_engine_exact import engine_decode
from tests.gpu.gpu_common import CUDA, ENGINE, GPU_MARKS, first_difference, reference, report

pytestmark = GPU_MARKS
ARCHS = os.environ.get("SMOE_GPU_LONG_ARCHS", "qwen3_moe,deepseek_v3,gpt_oss").split(",")
BITS = [int(b) for b in os.environ.get("SMOE_GPU_LONG_BITS", "4,16").split(",")]
LENGTHS = [int(n) for n in os.environ.get("SMOE_GPU_LONG_LENGTHS", "1000,4000").split(",")]
STEPS = 8


@pytest.mark.asyncio(loop_factories=["uvloop"])  # the loop smoe runs on; GPU time is scarce
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("arch", ARCHS)
async def test_long_prompts_give_mlx_lms_tokens_at_every_ring(arch, bits, models):
    if bits == 16 and not CUDA:
        pytest.skip("MLX's CPU gather_mm computes float32 only")
    vault, model = models(arch, bits)
    m = vault.manifest
    top = min(4000, int(vault.config()["vocab_size"]))
    smallest = m.shape.experts_per_token
    rings = [smallest, max(smallest, m.num_records // 4), m.num_records]
    wrong = []
    for n in LENGTHS:
        prompt = np.random.default_rng(n).integers(10, top, n).tolist()
        want, want_logits = reference(model, prompt, STEPS)
        for slots in rings:
            async with Engine.open(vault.path, slots=slots, max_context=n + 16, **ENGINE) as e:
                assert e.debug.runner.layer_major
                logits, tokens = await engine_decode(e, prompt, want)
            same = sum(np.array_equal(a, b) for a, b in zip(logits, want_logits, strict=True))
            cell = {
                "test": "long prompt",
                "arch": arch,
                "bits": bits,
                "prompt_tokens": n,
                "slots": slots,
                "tokens_equal": tokens == want,
                "first_difference": first_difference(tokens, want),
                "steps_bit_identical": f"{same}/{STEPS}",
            }
            report(cell)
            if tokens != want or same != STEPS:
                wrong.append(cell)
    assert not wrong, wrong  # every cell is run and reported first
