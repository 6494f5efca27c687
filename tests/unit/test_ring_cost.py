"""A decode step costs what its chosen experts cost, never something that grows with the ring.

Measured with MLX's memory counters (bytes a step allocates beyond what is resident), not
wall time: exact and noise-free. The check is shown to catch the fault it guards against
(bfloat16 scales computed on in place with float32 activations: the kernels convert every
slot's scales on every call).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import smoe.plan.ring as ring_module
from smoe.engine import Engine
from smoe.sampling import SamplingParams
from smoe.vault.convert import ConvertOptions, convert
from tests.conftest import make_hf_checkpoint

EXPERTS = 64  # 128 records: a ring of all of them is 64x the minimum


@pytest.fixture(scope="module")
def vaults(tmp_path_factory):
    root = tmp_path_factory.mktemp("ring-cost")
    src = make_hf_checkpoint(root / "hf", "qwen3_moe", num_experts=EXPERTS, num_experts_per_tok=2)
    return {
        "bfloat16 scales": convert(src, root / "bf16"),
        "float32 scales": convert(src, root / "f32", ConvertOptions(dtype="float32")),
    }


async def step_bytes(vault, slots: int) -> int:
    """Bytes MLX allocates during one warm decode step beyond what was resident before."""
    prompt = list(range(2, 18))
    async with Engine.open(vault.path, slots=slots, lookahead=False) as engine:
        seq = await engine.debug.compute.run(engine.debug.runner.start, prompt, SamplingParams())
        for _ in range(3):  # warm: the ring holds what it can, kernels are compiled
            await engine.debug.compute.run(engine.debug.runner.step, seq)

        def measured_step() -> int:
            mx.synchronize()
            before = mx.get_active_memory()
            mx.reset_peak_memory()
            engine.debug.runner.step(seq)
            mx.synchronize()
            return int(mx.get_peak_memory() - before)

        return min([await engine.debug.compute.run(measured_step) for _ in range(3)])


def float_ring_bytes(vault, slots: int) -> int:
    """What converting every slot's float components to float32 would allocate."""
    floats = [c for c in vault.manifest.record.components if "float" in c.dtype]
    return slots * sum(math.prod(c.shape) * 4 for c in floats)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["bfloat16 scales", "float32 scales"])
async def test_bytes_touched_per_step_do_not_grow_with_the_ring(vaults, kind):
    vault = vaults[kind]
    m = vault.manifest
    small = await step_bytes(vault, 2)
    large = await step_bytes(vault, m.num_records)
    assert large - small < float_ring_bytes(vault, m.num_records) / 4, (small, large)


@pytest.mark.asyncio
async def test_the_check_catches_a_ring_converted_on_every_call(vaults, monkeypatch):
    """Forced onto a unified ring, bfloat16 scales with float32 activations make every
    call convert the whole ring's scales: the same measurement sees it."""
    vault = vaults["bfloat16 scales"]
    m = vault.manifest
    monkeypatch.setattr(ring_module, "needs_conversion", lambda *a: False)
    small = await step_bytes(vault, 2)
    large = await step_bytes(vault, m.num_records)
    assert large - small > float_ring_bytes(vault, m.num_records) / 2, (small, large)
    assert np.isfinite(large)
