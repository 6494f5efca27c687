"""Router hints in the live engine (``--policy lru+hint``): the output is unchanged, only the
eviction order is; and a live run's misses equal the offline replay of the routing archive
it recorded (``smoe.telemetry.replay`` with the same hints), so the simulator and the
scheduler agree on engine data.

On the built-in demo (32 experts top-4 in 6 layers, learned routing): a ring of 48 of its
192 records evicts all the time, and gate ranks 4..15 carry real signal.
"""

from __future__ import annotations

import numpy as np
import pytest

from smoe.bench.policy import foresight_from_archive, stream_from_archive
from smoe.chat.demo import demo_vault
from smoe.engine import Engine
from smoe.errors import SmoeError
from smoe.sched.hints import runner_ups, split_policy_name
from smoe.sched.types import Priority
from smoe.telemetry.archive import DECODE, NO_EXPERT
from smoe.telemetry.replay import replay

SLOTS = 48  # a quarter of the demo's 192 records; its widest prefill request needs 32
PROMPT = "And God said, Let there be light: and there was light."
DEPTH = 16  # the default hint depth for top-4 (4 x top_k), and the archive's depth


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SMOE_CACHE", str(tmp_path_factory.mktemp("cache")))
        return demo_vault()


async def _run(vault, policy: str, *, tokens: int = 40, lookahead: bool = False, **options):
    """Teacher-forced logits of the prompt, then a sampled generation, recorded."""
    async with Engine.open(
        vault, slots=SLOTS, policy=policy, lookahead=lookahead, **options
    ) as engine:
        ids = engine.encode(PROMPT)
        engine.learning.start_recording(DEPTH)
        logits = await engine.logits(ids)
        out = []
        async for event in engine.generate(
            ids, max_tokens=tokens, temperature=0.8, seed=7, stop_at_eos=False
        ):
            if event.token is not None:
                out.append(event.token)
        archive = engine.learning.stop_recording()
        return logits, out, archive, engine.stats().scheduler, engine.debug.tracer


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
@pytest.mark.parametrize("policy", ["lru", "lfu"])
async def test_hints_change_eviction_not_output(vault, policy):
    logits, tokens, _, plain, _ = await _run(vault, policy)
    logits_h, tokens_h, _, hinted, tracer = await _run(vault, policy + "+hint")
    assert np.array_equal(logits, logits_h)  # bit for bit
    assert tokens == tokens_h and len(tokens) == 40
    assert tracer.hint_depth == DEPTH  # 4 x top_k by default
    assert plain.hints == 0 and hinted.hints > 0
    # the same requests, another eviction order: different reads
    assert hinted.hits + hinted.misses == plain.hits + plain.misses
    assert hinted.misses != plain.misses


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
@pytest.mark.parametrize("policy", ["lru+hint", "lfu+hint", "lru-layer+hint", "lru", "lfu"])
async def test_live_misses_equal_the_offline_replay(vault, policy):
    """No speculation (lookahead off, no gate echo): every read is a demand miss that the
    replay of the recorded archive, fed the same hints, must count identically."""
    _, _, archive, stats, _ = await _run(vault, policy, tokens=60)
    base, hinted = split_policy_name(policy)
    stream = stream_from_archive(archive, hint_depth=DEPTH)
    sim = replay(stream, SLOTS, base, hints=hinted)
    assert (stats.hits, stats.misses) == (sim.hits, sim.misses)
    assert stats.by_priority[Priority.SPECULATIVE].reads == 0  # nothing speculative
    if hinted:  # the keys the engine hinted are the stream's resident hints
        assert stats.hints > 0


@pytest.mark.asyncio
async def test_hint_depth_option(vault):
    _, _, archive, stats, tracer = await _run(vault, "lru+hint", tokens=8, hint_depth=8)
    assert tracer.hint_depth == 8
    sim = replay(stream_from_archive(archive, hint_depth=8), SLOTS, "lru", hints=True)
    assert (stats.hits, stats.misses) == (sim.hits, sim.misses)
    deeper = replay(stream_from_archive(archive, hint_depth=DEPTH), SLOTS, "lru", hints=True)
    assert deeper.misses != sim.misses  # the depth is what the engine used


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("policy", "options", "message"),
    [
        ("arc+hint", {}, "takes no hints"),
        ("hot+hint", {}, "takes no hints"),
        ("lru", {"hint_depth": 8}, "needs a '\\+hint' policy"),
        ("lru+hint", {"hint_depth": 4}, "hint_depth must lie in 5..32"),
        ("lru+hint", {"hint_depth": 33}, "hint_depth must lie in 5..32"),
    ],
)
async def test_bad_hint_options_are_refused(vault, policy, options, message):
    with pytest.raises(SmoeError, match=message):
        async with Engine.open(vault, slots=SLOTS, policy=policy, **options):
            pass


@pytest.mark.asyncio
async def test_recorded_lookahead_is_what_the_engine_predicted(vault):
    """The archive's lookahead (the next MoE layer's router on this layer's input) is the
    ranking the engine prefetched from: its top-k gives the engine's own lookahead recall.
    Replayed as prefetches, it turns demand misses into hits."""
    _, _, archive, _, tracer = await _run(vault, "lru", tokens=30, lookahead=True)
    assert archive.ahead is not None and archive.ahead.shape == archive.ranks.shape
    assert (archive.ahead[:, 0] == NO_EXPERT).all()  # nothing predicts the first layer
    assert (archive.ahead[:, 1:] != NO_EXPERT).all()  # prefill too, when recording
    k = archive.top_k
    hits = total = 0
    decode = np.nonzero(archive.phase == DECODE)[0]
    for row in decode:
        for pos in range(1, len(archive.layers)):
            used = set(archive.ranks[row, pos, :k].tolist())
            hits += len(used & set(archive.ahead[row, pos, :k].tolist()))
            total += len(used)
    assert (tracer.counters.lookahead_hits, tracer.counters.lookahead_total) == (hits, total)
    assert 0 < hits < total
    stream, spec = foresight_from_archive(archive, lookahead=True)
    got = replay(stream.with_foresight(None, spec["lookahead"]), SLOTS, "lru", prefetch=True)
    assert got.spec_used > 0 and got.misses < replay(stream, SLOTS, "lru").misses


def test_runner_ups_are_the_unused_experts_of_the_deeper_ranks():
    ranking = np.array([[3, 1, 7, 0, 5, 2], [1, 4, 3, 6, 2, 9]])  # used first: top-2
    # used {1, 3, 4}; ranks 2..4: {7, 0, 5} and {3, 6, 2} -> unused: 0, 2, 5, 6, 7
    assert runner_ups(ranking, 2, 5) == [0, 2, 5, 6, 7]
    assert runner_ups(ranking[:1], 2, 4) == [0, 7]
    assert runner_ups(ranking, 2, 2) == []
    assert split_policy_name("lfu+hint") == ("lfu", True)
    assert split_policy_name("lfu") == ("lfu", False)
