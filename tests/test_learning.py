"""The learning cache: per-vault popularity kept across runs, idle pre-warm, hot set."""

from __future__ import annotations

import asyncio
import shutil

import numpy as np
import pytest

from smoe.engine import Engine
from smoe.learning import Popularity
from smoe.sched.types import Priority, SlotState
from smoe.synth import synthesize
from smoe.vault.convert import ConvertOptions, convert

pytestmark = pytest.mark.asyncio


@pytest.fixture
def vault(tmp_path_factory):
    root = tmp_path_factory.mktemp("learn")
    return convert(
        synthesize(root / "src", arch="qwen3_moe", preset="tiny", seed=9),
        root / "v",
        ConvertOptions(dtype="float32"),
    )


async def drain(engine):
    """Wait for the pre-warm reads (real I/O threads: poll the scheduler)."""
    while engine.scheduler.in_flight or engine.scheduler.queue_depth(Priority.SPECULATIVE):  # noqa: ASYNC110
        await asyncio.sleep(0.005)


async def test_popularity_is_kept_per_vault_and_merged(vault, tmp_path):
    async with Engine.open(vault.path) as engine:
        await engine.logits(list(range(5, 70)))
        first = engine.popularity.session.sum()
    assert first > 0
    saved = Popularity(vault).counts
    assert saved.sum() == first
    other = tmp_path / "other"
    shutil.copytree(vault.path, other)
    (other / "stats" / "popularity.npz").unlink()
    async with Engine.open(vault.path) as engine:
        await engine.logits(list(range(5, 70)))
    assert Popularity(vault).counts.sum() == 2 * first  # merged, not overwritten
    from smoe.vault.format import Vault

    assert Popularity(Vault.open(other)).counts.sum() == 0  # never shared between vaults
    assert not list((vault.path / "stats").glob(".*"))  # no temp files left


async def test_prewarm_fills_only_empty_slots_and_changes_no_bit(vault):
    prompt = list(range(20, 90))
    async with Engine.open(vault.path, slots=10) as engine:
        await engine.logits(list(range(5, 40)))  # history
        expected = await engine.logits(prompt)
    async with Engine.open(vault.path, slots=10) as engine:
        queued = engine.prewarm()
        assert queued == 10  # an empty ring: every slot gets a hot expert
        await drain(engine)
        hot = engine.popularity.hottest(10)
        assert all(engine.scheduler.state_of(k) is SlotState.READY for k in hot)
        assert engine.prewarm() == 0  # the ring is full: pre-warm never evicts
        assert np.array_equal(await engine.logits(prompt), expected)


async def test_demand_drops_queued_prewarm(vault):
    async with Engine.open(vault.path, slots=10, workers=1) as engine:
        await engine.logits(list(range(5, 40)))
    async with Engine.open(vault.path, slots=10, workers=1) as engine:
        engine.prewarm()
        assert engine.scheduler.queue_depth(Priority.SPECULATIVE) > 0
        task = asyncio.get_running_loop().create_task(engine.logits([7, 8, 9]))
        await asyncio.sleep(0)  # let the request start
        await task
        # the request dropped the bets that had not started (at most `workers` ran)
        cancelled = engine.scheduler.stats.by_priority[Priority.SPECULATIVE].cancelled
        assert cancelled > 0
        engine.scheduler.check_invariants()


async def test_hot_policy_pins_the_history(vault):
    async with Engine.open(vault.path) as engine:
        await engine.logits(list(range(5, 70)))
    async with Engine.open(vault.path, slots=8, policy="hot") as engine:
        assert len(engine.scheduler.policy.hot) == 4
        await engine.logits(list(range(5, 30)))
        engine.scheduler.check_invariants()
