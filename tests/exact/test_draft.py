"""Prompt-lookup drafting (--draft ngram) is lossless: greedy tokens equal plain decoding's
on mlx-lm's in-memory model and on real engines at several ring sizes; sampled tokens follow
the distribution mlx-lm's sampler draws from (chi-square); a verify pass asks for the union
of its tokens' experts once per layer; the governor stops drafting that does not pay."""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chisquare

from smoe.compute.draft import (
    DraftGovernor,
    Drafting,
    NgramDrafter,
    accept_sampled,
    target_probs,
)
from smoe.compute.runner import Runner
from smoe.engine import Engine
from smoe.errors import SmoeError
from smoe.plan.options import EngineOptions
from smoe.sampling import SamplingParams
from tests.conftest import tiny_vault
from tests.exact.test_build_ahead import model  # noqa: F401  (the module's in-memory model)

LOOP = [5, 9, 31, 7, 64, 2, 17, 88, 40, 3] * 3  # a prompt to look up in


# ---------------------------------------------------------------- the drafter
def test_ngram_takes_the_longest_suffix_and_its_latest_match():
    d = NgramDrafter(max_n=3, min_n=1)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3]
    # suffix [1, 2, 3] recurs at 0 (followed by 9, 2, 3); the 2-gram [2, 3] recurs later
    # (at 4) but the longer match wins
    assert d.propose(tokens, 3) == [9, 2, 3]
    assert d.propose([4, 2, 3, 8, 6, 2, 3], 2) == [8, 6]  # [2, 3]: latest earlier match at 1
    assert d.propose([4, 3, 5, 3, 6, 3], 4) == [6, 3]  # [3]: latest match at 3, to the end
    assert d.propose([4, 3, 5, 3, 6, 3], 0) == []


def test_ngram_proposes_nothing_without_a_match_of_min_n():
    d = NgramDrafter(max_n=4, min_n=2)
    assert d.propose([1, 2, 3, 4, 5, 6, 3], 4) == []  # only a 1-gram recurs
    assert d.propose([7, 7], 4) == []  # too short to hold an earlier 2-gram
    assert d.propose([7, 7, 7], 4) == [7]
    with pytest.raises(ValueError):
        NgramDrafter(max_n=1, min_n=2)


# ---------------------------------------------------------------- the acceptance rule
def test_accept_sampled_gives_exactly_p():
    p = np.array([0.05, 0.4, 0.3, 0.15, 0.1])
    trials = 40_000
    rng = np.random.default_rng(7)
    for draft in (1, 4):  # a likely and an unlikely draft
        counts = np.zeros(len(p))
        accepted = 0
        for _ in range(trials):
            ok, token = accept_sampled(draft, p, rng)
            accepted += ok
            assert ok == (token == draft)  # a rejection never gives the draft back
            counts[token] += 1
        assert chisquare(counts, p * trials).pvalue > 1e-3
        assert abs(accepted / trials - p[draft]) < 4 * math.sqrt(p[draft] / trials)
    assert accept_sampled(2, np.array([0.0, 0.0, 1.0]), rng) == (True, 2)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.3, top_k=4),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.6, min_p=0.1),
    ],
    ids=["temp", "top_k", "top_p", "min_p"],
)
def test_target_probs_is_what_mlx_lm_samples_from(params):
    from mlx_lm.sample_utils import make_sampler

    logits = mx.array(np.random.default_rng(3).normal(0, 0.8, (1, 12)).astype(np.float32))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    p = target_probs(logprobs, params)
    assert abs(p.sum() - 1) < 1e-9
    sampler = make_sampler(params.temperature, params.top_p, params.min_p, 1, top_k=params.top_k)
    mx.random.seed(5)
    n = 20_000
    draws = np.array(sampler(mx.broadcast_to(logprobs, (n, 12))))
    counts = np.bincount(draws, minlength=12)
    assert (counts[p == 0] == 0).all()  # filtered tokens are never drawn
    keep = p > 0
    assert keep.sum() >= 2  # a distribution, not a forced token
    assert chisquare(counts[keep], p[keep] * n).pvalue > 1e-3


# ---------------------------------------------------------------- the governor
def test_governor_switches_off_when_drafting_does_not_pay_then_retries():
    g = DraftGovernor(min_passes=3, probe_every=100, backoff=2)
    g.plain(1.0)
    for _ in range(2):
        g.verified(1.5, 1)  # one token per 1.5 s against one per second
        assert g.wants_draft()
    g.verified(1.5, 1)
    assert not g.wants_draft() and g.switch_offs == 1 and g.backoff == 4
    g.plain(1.0)
    assert not g.wants_draft()
    g.plain(1.0)  # backoff over: judged afresh
    assert g.wants_draft() and g.passes == 0
    for _ in range(5):
        g.verified(1.5, 3)  # three tokens per 1.5 s: pays
    assert g.wants_draft() and g.switch_offs == 1 and g.pays()


def test_governor_probes_a_plain_step_when_it_has_none_or_it_is_stale():
    g = DraftGovernor(min_passes=2, probe_every=3)
    g.verified(1.0, 2)
    assert g.wants_draft()
    g.verified(1.0, 2)
    assert not g.wants_draft() and g.pays() is None  # no plain figure yet: probe
    g.plain(1.0)
    assert g.wants_draft() and g.pays()
    for _ in range(3):
        g.verified(1.0, 2)
    assert not g.wants_draft()  # three passes since the last plain step


# ---------------------------------------------------------------- the runner, in memory
def plain_tokens(model, prompt, params, n):  # noqa: F811
    r = Runner(model)
    seq = r.start(prompt, params)
    return [r.step(seq) for _ in range(n)]


def steady(**fields) -> Drafting:
    """Drafting whose governors never judge (no switch-off): these tests check tokens, and
    a judgement fed from the wall clock would make them depend on this machine's speed."""
    return Drafting(governor=lambda: DraftGovernor(min_passes=10**9), **fields)


def drafted(runner: Runner, prompt, params, n):
    seq = runner.start(prompt, params)
    out: list[int] = []
    while len(out) < n:
        out += runner.step_draft(seq, n - len(out))
        # A plain step while drafting is off may have queued the next pass (build ahead).
        ahead = 0 if seq.ahead is None else 1
        assert seq.cached == len(seq.tokens) - 1
        assert all(c.offset == seq.cached + ahead for c in seq.cache)
    return seq, out


@pytest.mark.parametrize("resident", [False, True], ids=["streamed", "built-ahead"])
@pytest.mark.parametrize("k", [1, 4, 7])
def test_greedy_draft_tokens_are_plain_greedy_tokens(model, k, resident):  # noqa: F811
    params = SamplingParams(repetition_penalty=1.1) if k == 7 else SamplingParams()
    want = plain_tokens(model, LOOP, params, 40)
    runner = Runner(model, resident=(lambda: True) if resident else None, drafting=steady(tokens=k))
    seq, got = drafted(runner, LOOP, params, 40)
    assert got == want and seq.tokens == [*LOOP, *want]
    stats = runner.drafting.stats
    assert stats.accepted > 0 and stats.accepted < stats.drafted  # both branches ran


def test_switching_off_and_back_on_over_a_pass_built_ahead_keeps_the_tokens(model):  # noqa: F811
    """A drafter that is always wrong, on a forced clock: drafting is switched off, plain
    steps build ahead, and the retry after the backoff drops the pass built ahead."""
    want = plain_tokens(model, LOOP, SamplingParams(), 40)
    truth = [*LOOP, *want]
    governor = lambda: DraftGovernor(min_passes=2, backoff=3)  # noqa: E731
    wrong = Drafting(drafter=WrongDrafter(truth), tokens=2, governor=governor, clock=Ticks())
    runner = Runner(model, resident=lambda: True, drafting=wrong)
    seq, got = drafted(runner, LOOP, SamplingParams(), 40)
    assert got == want and seq.tokens == truth
    assert wrong.stats.switch_offs >= 2 and wrong.stats.accepted == 0
    assert runner.built_ahead > 0  # the off stretches built ahead


def test_a_stop_token_ends_the_accepted_run(model):  # noqa: F811
    want = plain_tokens(model, LOOP, SamplingParams(), 40)
    stop = want[20]
    first = want.index(stop)
    runner = Runner(model, drafting=steady())
    seq = runner.start(LOOP, SamplingParams())
    out: list[int] = []
    while not out or out[-1] != stop:
        out += runner.step_draft(seq, 40 - len(out), frozenset([stop]))
    assert out == want[: first + 1]
    assert all(c.offset == len(seq.tokens) - 1 for c in seq.cache)


def test_sampled_verify_draws_from_the_target_distribution(model):  # noqa: F811
    """The first token a verify pass returns is distributed as p1 (the distribution plain
    decoding samples from there); after an accepted draft, the next one as p2 given it."""
    params = SamplingParams(temperature=1.5, top_k=4)
    runner = Runner(model, drafting=steady(rng=np.random.default_rng(0)))
    seq = runner.start(LOOP, params)
    logits = runner.model(mx.array([LOOP[-1:]]), cache=runner.copy(seq).cache)[:, -1, :]
    p1 = target_probs(logits - mx.logsumexp(logits, axis=-1, keepdims=True), params)
    d1 = int(np.argsort(p1)[-2])  # the second most likely: accepted about p1[d1] of the time
    y = runner.model(mx.array([[LOOP[-1], d1]]), cache=runner.copy(seq).cache)[:, -1, :]
    p2 = target_probs(y - mx.logsumexp(y, axis=-1, keepdims=True), params)
    first, second = np.zeros(len(p1)), np.zeros(len(p2))
    trials = 1500
    for _ in range(trials):
        runner.prepare(seq, LOOP, params)  # back to the prompt: the cache is trimmed
        out = runner.verify(seq, [d1, 0])
        first[out[0]] += 1
        if out[0] == d1:
            second[out[1]] += 1
    keep1, keep2 = p1 > 0, p2 > 0
    assert (first[~keep1] == 0).all() and (second[~keep2] == 0).all()
    assert chisquare(first[keep1], p1[keep1] * trials).pvalue > 1e-3
    assert chisquare(second[keep2], p2[keep2] * second.sum()).pvalue > 1e-3


def test_seeded_sampling_with_drafts_repeats_itself(model):  # noqa: F811
    params = SamplingParams(temperature=0.9, seed=4)
    a = drafted(Runner(model, drafting=steady()), LOOP, params, 24)[1]
    b = drafted(Runner(model, drafting=steady()), LOOP, params, 24)[1]
    assert a == b


# ---------------------------------------------------------------- real engines
@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    return tiny_vault(tmp_path_factory.mktemp("draft"), seed=13)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from smoe.chat.demo import demo_vault

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SMOE_CACHE", str(tmp_path_factory.mktemp("cache")))
        return demo_vault()


async def generate(path, ids, n, **options) -> tuple[list[int], dict]:
    async with Engine.open(path, **options) as engine:
        out = [
            e.token
            async for e in engine.generate(ids, max_tokens=n, stop_at_eos=False)
            if e.token is not None
        ]
        d = engine.debug.runner.drafting
        return out, (d.stats.to_json() if d is not None else {})


def kjv_prompt(demo_path) -> list[int]:
    from pathlib import Path

    from mlx_lm.utils import load_tokenizer

    text = (Path(__file__).parents[1] / "data" / "kjv_held_out.txt").read_text(encoding="utf-8")
    passage = text[:400].rsplit(" ", 1)[0]
    opening = " ".join(passage.split()[:8])
    return list(load_tokenizer(demo_path).encode(f"{passage} {passage} {opening}"))


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
@pytest.mark.parametrize("slots", [4, 30, None], ids=["min", "small", "all"])
async def test_engine_greedy_with_drafts_equals_plain_on_the_demo(demo, slots):
    ids = kjv_prompt(demo)
    want, _ = await generate(demo, ids, 48, slots=slots)
    got, stats = await generate(demo, ids, 48, slots=slots, draft="ngram")
    assert got == want
    assert stats["verify_passes"] > 0 and stats["accepted"] > 0


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
@pytest.mark.parametrize("slots", [8, None], ids=["small-ring", "all"])
async def test_engine_greedy_with_drafts_equals_plain_on_a_tiny_checkpoint(vault, slots):
    ids = [3, 17, 40, 9, 22, 61, 5, 12] * 4
    want, _ = await generate(vault.path, ids, 40, slots=slots)
    got, stats = await generate(vault.path, ids, 40, slots=slots, draft="ngram", draft_tokens=3)
    assert got == want and stats["verify_passes"] > 0


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
async def test_a_verify_pass_asks_for_each_needed_expert_once(vault):
    """Per MoE layer, the verify pass requests the union of its tokens' experts (each a
    hit or a read), not one request per token's expert."""
    async with Engine.open(vault.path, slots=16, lookahead=False, draft="ngram") as engine:
        runner, sched = engine.debug.runner, engine.debug.scheduler

        def prefilled():
            return runner.start([3, 17, 40, 9, 22, 61, 5, 12], SamplingParams())

        seq = await engine.debug.compute.run(prefilled)
        routed: list[tuple[int, np.ndarray]] = []
        engine.debug.tracer.observers.on_routing = lambda layer, idx: routed.append((layer, idx))
        before = sched.stats.hits + sched.stats.misses
        read_before = sched.stats.bytes_read()
        out = await engine.debug.compute.run(runner.verify, seq, [33, 34, 35, 36])
        asked = sched.stats.hits + sched.stats.misses - before
        engine.debug.tracer.observers.on_routing = None
        assert out and all(idx.shape[0] == 5 for _, idx in routed)  # one call of 5 tokens
        union = sum(len(np.unique(idx)) for _, idx in routed)
        per_token = sum(len(np.unique(row)) for _, idx in routed for row in idx)
        assert asked == union < per_token
        stride = vault.manifest.record.stride
        assert sched.stats.bytes_read() - read_before <= union * stride


@dataclass
class RightDrafter:
    """Proposes what the model will say (the plain greedy stream, known in advance)."""

    truth: list[int]  # the plain greedy stream (prompt + reply)

    def propose(self, tokens, k):
        return self.truth[len(tokens) : len(tokens) + k]


class WrongDrafter(RightDrafter):
    """A forced non-repetitive stream: it always proposes what the model will not say."""

    def propose(self, tokens, k):
        return [(t + 1) % 256 for t in super().propose(tokens, k)]


class Ticks:
    """A clock that advances one unit per reading: a verify pass 'takes' what a plain step
    does, so a pass that yields one token does not pay (deterministic, no timing)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
async def test_drafting_that_does_not_pay_is_switched_off(vault):
    ids = [3, 17, 40, 9, 22, 61, 5, 12]
    want, _ = await generate(vault.path, ids, 40)
    async with Engine.open(vault.path, draft="ngram") as engine:
        wrong = Drafting(drafter=WrongDrafter([*ids, *want]), tokens=3, clock=Ticks())
        engine.debug.runner.drafting = wrong  # the engine's step_draft drafts with it
        got = [
            e.token
            async for e in engine.generate(ids, max_tokens=40, stop_at_eos=False)
            if e.token is not None
        ]
    s = wrong.stats
    assert got == want and s.accepted == 0
    # 4 verify passes (min_passes), a plain step for the governor's plain figure, a 5th
    # pass judged not to pay (one token per tick against one per tick), then 32 plain
    # steps (the backoff) before it tries again
    # steps; then one more pass (k = 1 for the last two tokens) and a last plain step
    assert s.switch_offs == 1 and s.verify_passes == 6 and s.plain_steps == 34


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
async def test_drafting_that_pays_stays_on(vault):
    ids = [3, 17, 40, 9, 22, 61, 5, 12]
    want, _ = await generate(vault.path, ids, 40)
    truth = [*ids, *want]
    async with Engine.open(vault.path, draft="ngram") as engine:
        right = Drafting(drafter=RightDrafter(truth), tokens=3, clock=Ticks())
        engine.debug.runner.drafting = right
        got = [
            e.token
            async for e in engine.generate(ids, max_tokens=40, stop_at_eos=False)
            if e.token is not None
        ]
    assert got == want and right.stats.switch_offs == 0
    assert right.stats.accepted == right.stats.drafted > 0


def test_draft_options_are_checked():
    with pytest.raises(SmoeError, match="unknown draft"):
        EngineOptions(draft="eagle").check(2, 8)
    with pytest.raises(SmoeError, match="draft_tokens"):
        EngineOptions(draft="ngram", draft_tokens=0).check(2, 8)
    with pytest.raises(SmoeError, match="--distributed"):
        EngineOptions(draft="ngram", distributed="ring").check(2, 8)
    EngineOptions(draft="ngram", draft_tokens=8).check(2, 8)


def test_generate_cli_reports_the_drafts(vault, run_cli):
    import json

    code, out, _ = run_cli(
        "generate", vault.path, "--prompt-ids", "3,17,40,9,3,17,40,9,3,17",
        "--max-tokens", "12", "--draft", "ngram", "--draft-tokens", "2", "--json",
    )  # fmt: skip
    assert code == 0
    stats = json.loads(out)["stats"]["draft"]
    assert stats["verify_passes"] + stats["plain_steps"] >= 1
    code, _, err = run_cli("generate", vault.path, "--prompt-ids", "3,4", "--draft-tokens", "0")
    assert code == 1 and "draft_tokens must lie in 1..32" in err


# ---------------------------------------------------------------- the batcher's hook
@pytest.mark.asyncio
async def test_the_batcher_drafts_for_a_lone_request_and_steps_a_batch_plainly():
    """A drafted step's tokens are each an event, cut at max_tokens and at an EOS; with two
    requests decoding, one batched plain step (controlled fakes, no model)."""
    import asyncio

    from smoe.engine.batcher import Batcher, Meter
    from tests.unit.test_batcher import FakeRunner, GatedCompute, drain, ticket

    runner, calls = FakeRunner(), []

    def draft(seq, budget, eos):
        calls.append((seq.name, budget))
        new = [200 + len(seq.tokens) + i for i in range(min(3, budget))]
        seq.tokens += new
        return new

    batcher = Batcher(GatedCompute(), runner, asyncio.Lock(), Meter, draft=draft)
    a = batcher.submit(ticket("a", 0, 5))
    assert await drain(a) == [
        *[("token", t) for t in (200, 201, 202, 203, 204)],
        ("end", "length"),
    ]
    assert calls == [("a", 5), ("a", 2)]  # the second step may give 2 tokens at most
    b = batcher.submit(ticket("b", 0, 9, eos=frozenset([201])))
    assert await drain(b) == [("token", 200), ("token", 201), ("end", "stop")]
    c, d = batcher.submit(ticket("c", 0, 2)), batcher.submit(ticket("d", 0, 2))
    got_c, got_d = await asyncio.gather(drain(c), drain(d))
    assert got_c == got_d == [("token", 100), ("token", 101), ("end", "length")]
    assert "step c,d" in runner.log and calls[-1][0] == "b"  # batched: no drafts
    await batcher.close()


def test_drafting_on_a_gpu_needs_the_per_row_attention():
    """Under kernel rules (a GPU) a verify pass runs attention one row at a time, which
    needs the architecture's per-row attention; the CPU drafts for any architecture."""
    from smoe.compute.solo_rows import CUDA
    from smoe.plan.ring import check_draft

    check_draft("ngram", None, batchable=False)  # the CPU
    check_draft("ngram", CUDA, batchable=True)
    check_draft(None, CUDA, batchable=False)
    with pytest.raises(SmoeError, match="--draft on a GPU needs per-row attention"):
        check_draft("ngram", CUDA, batchable=False)
