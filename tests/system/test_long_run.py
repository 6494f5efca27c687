"""A long-running engine holds bounded state: 2,000 decode steps with every trace on."""

from __future__ import annotations

import gc
import resource

import pytest

import smoe.compute.tracing as tracing
from smoe.engine import Engine
from tests.conftest import tiny_vault

pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])  # 18 s: the loop smoe serves on


def rss_bytes() -> int:
    """Resident set size now (not the peak): /proc/self/statm's second field."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


async def test_two_thousand_decode_steps_hold_bounded_traces_and_flat_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(tracing, "CALLS_KEPT", 1000)  # the real cap (8,192) bounds alike
    vault = tiny_vault(tmp_path, seed=5)
    layers = len(vault.manifest.layers)
    # A small ring (misses every step), lookahead and gate echo on: every trace is busy.
    async with Engine.open(vault.path, slots=8, spec=2) as engine:

        async def decode(steps: int, seed: int) -> None:
            n = 0
            events = engine.generate(
                [5, 6, 7, 8], max_tokens=steps, temperature=1.0, seed=seed, stop_at_eos=False
            )
            async for ev in events:
                n += ev.token is not None
            assert n == steps

        await decode(500, 0)  # warm: kernels, ring, allocator pools
        gc.collect()
        warm = rss_bytes()
        for seed in (1, 2, 3):
            await decode(500, seed)
        gc.collect()
        after = rss_bytes()
        tracer = engine.debug.tracer
        assert len(tracer.counters.calls) == 1000 < 2000 * layers  # the oldest were dropped
        assert not hasattr(tracer, "step")  # a pass's state ends with it (forward_pass)
    assert after <= warm * 1.05, (warm, after)
