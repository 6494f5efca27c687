"""Log-probabilities equal mlx-lm's in memory, bit for bit.

The reference is mlx-lm's model for the same vault (``reference_model``), run as
``mlx_lm.generate_step`` runs it: the prompt but its last token prefilled in chunks, then one
token at a time, each step's ``logprobs = logits - mx.logsumexp(logits, keepdims=True)``
(float32 weights: the logits are float32). A generated token's log-probability and its
likeliest alternatives are read from that row; a prompt token's from the prefill's logits
(the chunk's row before it). The engine gives the same numbers alone, batched with other
requests, with prompt-lookup drafts (a verify pass's logits), built ahead on a resident
model, under a logit bias (its tokens are mlx-lm's with its logit_bias processor; the numbers
stay the model's own) and with seeded sampling; asking for them never changes a token.
"""

from __future__ import annotations

import asyncio

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

from smoe.compute.logprobs import top_logprobs
from smoe.engine import Engine
from smoe.errors import SmoeError
from smoe.sampling import TokenLogprob
from tests.exact.test_engine_exact import CHUNK, _prompt

STEPS = 12
K = 5


def ranked(row: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The ``k`` likeliest ids of ``row``, likeliest first, ties by the lower id (a stable
    sort: independent of ``top_logprobs``' argpartition)."""
    order = np.argsort(-row, kind="stable")[:k]
    return [(int(i), float(row[i])) for i in order]


def reference(
    model,
    prompt: list[int],
    steps: int,
    k: int = K,
    forced: list[int] | None = None,
    bias: dict[int, float] | None = None,
) -> tuple[list[int], list[TokenLogprob], list[TokenLogprob]]:
    """mlx-lm in memory, as generate_step: (greedy tokens, their entries, the prompt's).
    ``forced``: the tokens to feed instead of the greedy ones (a sampled run's);
    ``bias``: mlx-lm's logit_bias processor before the greedy pick (not in the numbers)."""
    cache = make_prompt_cache(model)
    head = prompt[:-1]
    prompt_scores = []
    for start in range(0, len(head), CHUNK):
        piece = head[start : start + CHUNK]
        y = model(mx.array(piece)[None], cache=cache)[0]  # [n, V] float32
        rows = np.array(y - mx.logsumexp(y, axis=-1, keepdims=True))
        for i, target in enumerate(prompt[start + 1 : start + 1 + len(piece)]):
            prompt_scores.append(
                TokenLogprob(target, float(rows[i, target]), tuple(ranked(rows[i], k)))
            )
    processors = make_logits_processors(bias) if bias else []
    tokens, scores = list(prompt), []
    for step in range(steps):
        logits = model(mx.array(tokens[-1:])[None], cache=cache)[:, -1, :]  # [1, V]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)  # generate_step's
        row = np.array(logprobs[0])
        drawn = logits
        for p in processors:
            drawn = p(mx.array(tokens), drawn)
        pick = int(mx.argmax(drawn - mx.logsumexp(drawn, keepdims=True), axis=-1).item())
        token = forced[step] if forced is not None else pick
        scores.append(TokenLogprob(token, float(row[token]), tuple(ranked(row, k))))
        tokens.append(token)
    return tokens[len(prompt) :], scores, prompt_scores


async def run(engine: Engine, prompt: list[int], steps: int, **kw) -> tuple[list[int], list, list]:
    """(tokens, their entries, the prompt's) of one generate() call."""
    tokens, scores, prompt_scores = [], [], None
    async for ev in engine.generate(prompt, max_tokens=steps, stop_at_eos=False, **kw):
        if ev.prompt_logprobs is not None:
            assert prompt_scores is None and not tokens  # once, before the first token
            prompt_scores = ev.prompt_logprobs
        if ev.token is not None:
            tokens.append(ev.token)
            if kw.get("logprobs") is not None:
                assert ev.logprob is not None and ev.top_logprobs is not None
                scores.append(TokenLogprob(ev.token, ev.logprob, ev.top_logprobs))
            else:
                assert ev.logprob is None and ev.top_logprobs is None
    return tokens, scores, prompt_scores or []


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
async def test_alone_equal_mlx_lm_bit_for_bit(arch, quantized):
    vault, ref = quantized(arch)
    prompt = _prompt(70)  # a prefill of two chunks
    want_tokens, want, want_prompt = reference(ref, prompt, STEPS)
    async with Engine.open(vault.path) as engine:
        tokens, scores, prompt_scores = await run(
            engine, prompt, STEPS, logprobs=K, prompt_logprobs=K
        )
        assert tokens == want_tokens
        assert scores == want
        assert prompt_scores == want_prompt and len(prompt_scores) == len(prompt) - 1
        # not asked: the same tokens, no numbers
        plain, _, none = await run(engine, prompt, STEPS)
        assert plain == want_tokens and none == []
        # k = 0: the token's own number only; a prompt of one token has none
        _, bare, _ = await run(engine, prompt, 3, logprobs=0)
        assert bare == [TokenLogprob(s.token, s.logprob) for s in want[:3]]
        _, _, first = await run(engine, prompt[:1], 1, prompt_logprobs=2)
        assert first == []


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
async def test_prompt_only_and_a_cached_prefix(quantized):
    """max_tokens 0 runs the prompt alone; the prompt's numbers come from a prefill of the
    whole prompt even where an earlier request left its prefix in the cache."""
    vault, ref = quantized("qwen3_moe")
    prompt = _prompt(40, seed=3)
    _, _, want_prompt = reference(ref, prompt, 0, k=2)
    async with Engine.open(vault.path) as engine:
        events = [e async for e in engine.generate(prompt, max_tokens=0, prompt_logprobs=2)]
        assert [e.token for e in events] == [None, None]
        assert events[0].prompt_logprobs == want_prompt
        assert events[-1].finish_reason == "length" and events[-1].stats.generated_tokens == 0

        handles = []

        def keep(seq, run):
            handles.append((seq, run))

        params = dict(max_tokens=1, stop_at_eos=False, on_prepared=keep)
        from smoe.sampling import SamplingParams

        async for _ in engine.stream(prompt + [7, 8], SamplingParams(), **params):
            pass
        seq = handles[0][0]
        scored = SamplingParams(prompt_logprobs=2)
        got = [e async for e in engine.stream(prompt, scored, **params, sequence=seq)]
        assert handles[1][1] == len(prompt) - 1  # prefilled whole, the prefix not reused
        assert got[0].prompt_logprobs == want_prompt


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
async def test_prompt_numbers_over_several_passes_and_chunk_by_chunk(quantized):
    """A prompt longer than one layer-major pass (its numbers gathered pass after pass),
    and the chunk-by-chunk prefill (no layer-major pass): the same numbers."""
    vault, ref = quantized("qwen3_moe")
    prompt = _prompt(150, seed=9)  # chunks of 64, 64, 21 (the last token is not prefilled)
    _, _, want = reference(ref, prompt, 0, k=3)
    async with Engine.open(vault.path) as engine:
        runner = engine.debug.runner
        assert runner.layer_major
        for pass_tokens, layer_major in ((64, True), (128, True), (8192, False)):
            runner.pass_tokens, runner.layer_major = pass_tokens, layer_major
            events = [e async for e in engine.generate(prompt, max_tokens=0, prompt_logprobs=3)]
            assert events[0].prompt_logprobs == want, (pass_tokens, layer_major)


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
async def test_batched_requests_equal_their_solo_reference(quantized):
    """Concurrent requests of unequal prompts, some asking and some not, decode together
    (batched steps): each one's numbers are its solo reference's."""
    vault, ref = quantized("qwen3_moe")
    prompts = [_prompt(n, seed=10 + n) for n in (5, 30, 70, 3)]
    wants = [reference(ref, p, STEPS, k=3) for p in prompts]
    async with Engine.open(vault.path, max_batch=4) as engine:
        asks = [dict(logprobs=3, prompt_logprobs=3), {}, dict(logprobs=3), dict(logprobs=3)]
        got = await asyncio.gather(
            *(run(engine, p, STEPS, **a) for p, a in zip(prompts, asks, strict=True))
        )
        assert engine.stats().batch.mean_rows_per_step > 1  # they did share steps
        for i, ((tokens, scores, prompt_scores), (wt, ws, wp), a) in enumerate(
            zip(got, wants, asks, strict=True)
        ):
            assert tokens == wt, i
            assert scores == (ws if a else []), i
            assert prompt_scores == (wp if "prompt_logprobs" in a else []), i


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
async def test_drafted_tokens_carry_the_verify_pass_numbers(quantized):
    """With prompt-lookup drafts each accepted token's numbers come from the verify pass's
    logits at its position: equal to the plain step's (mlx-lm's)."""
    vault, ref = quantized("qwen3_moe")
    prompt = [3, 17, 40, 9, 22, 61, 5, 12] * 4
    steps = 32
    want_tokens, want, _ = reference(ref, prompt, steps)
    async with Engine.open(vault.path, draft="ngram", draft_tokens=3) as engine:
        tokens, scores, _ = await run(engine, prompt, steps, logprobs=K)
        stats = engine.debug.runner.drafting.stats
        assert stats.verify_passes > 0 and stats.accepted > 0
    assert tokens == want_tokens
    assert scores == want


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
async def test_built_ahead_on_a_resident_model(quantized):
    """A ring holding the whole model builds each step ahead (alone and batched): the
    numbers ride with the token built ahead."""
    vault, ref = quantized("qwen3_moe")
    m = vault.manifest
    prompts = [_prompt(20, seed=21), _prompt(9, seed=22)]
    wants = [reference(ref, p, STEPS) for p in prompts]
    async with Engine.open(vault.path) as engine:
        for spec in m.layers:  # every expert READY: pinned for good at the next pass
            engine.debug.scheduler.release(
                await engine.debug.scheduler.acquire(spec.layer, range(m.num_experts))
            )
        assert await engine.logits(prompts[0][:3]) is not None
        before = engine.debug.runner.built_ahead
        alone = await run(engine, prompts[0], STEPS, logprobs=K)
        assert engine.debug.runner.built_ahead > before
        both = await asyncio.gather(*(run(engine, p, STEPS, logprobs=K) for p in prompts))
    assert alone[:2] == wants[0][:2]
    for (tokens, scores, _), (wt, ws, _) in zip(both, wants, strict=True):
        assert tokens == wt and scores == ws


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
async def test_logit_bias_moves_the_tokens_not_the_numbers(quantized):
    vault, ref = quantized("qwen3_moe")
    prompt = _prompt(30, seed=4)
    plain, _, _ = reference(ref, prompt, STEPS)
    bias = {plain[0]: -100.0, 77: 5.0, 140: 2.5}
    want_tokens, want, _ = reference(ref, prompt, STEPS, bias=bias)
    assert want_tokens != plain  # the bias did change the greedy tokens
    async with Engine.open(vault.path) as engine:
        tokens, scores, _ = await run(engine, prompt, STEPS, logprobs=K, logit_bias=bias)
        assert tokens == want_tokens and scores == want
        with pytest.raises(SmoeError, match="outside the vocabulary"):
            await run(engine, prompt, 1, logit_bias={10**6: 1.0})
        with pytest.raises(SmoeError, match="logit_bias"):
            await run(engine, prompt, 1, logit_bias={3: 101.0})
        with pytest.raises(SmoeError, match="logprobs"):
            await run(engine, prompt, 1, logprobs=21)


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
async def test_seeded_sampling_reports_the_model_numbers(quantized):
    """Sampling (temperature, top-k) draws as without numbers; each drawn token's number
    is the model's log-softmax at its place (the temperature is the sampler's, not in it)."""
    vault, ref = quantized("qwen3_moe")
    prompt = _prompt(25, seed=8)
    settings = dict(temperature=1.3, top_k=20, seed=11)
    async with Engine.open(vault.path) as engine:
        plain, _, _ = await run(engine, prompt, STEPS, **settings)
        tokens, scores, _ = await run(engine, prompt, STEPS, logprobs=2, **settings)
    assert tokens == plain
    _, want, _ = reference(ref, prompt, STEPS, k=2, forced=tokens)
    assert scores == want


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
async def test_copies_decode_in_one_batch_with_their_original(quantized):
    """What n > 1 choices stand on (smoe/serve/choices.py): a sequence and copies of it
    (Runner.copy), each then fed other tokens, in one batched pass: every row's logits are
    its solo run's. (mlx-lm's KVCache.state is its arrays, which it writes in place: a copy
    holding them wrote into the original's cache.)"""
    from smoe.sampling import SamplingParams

    vault, _ = quantized("qwen3_moe")
    prompt = _prompt(20, seed=30)
    feeds = [[47, 79, 47, 79, 47], [47, 19, 79, 92, 79], [5, 6, 7, 8, 9]]
    async with Engine.open(vault.path, max_batch=4) as engine:
        runner, run = engine.debug.runner, engine.debug.compute.run
        solo = []
        for feed in feeds:
            seq = await run(runner.start, prompt, SamplingParams())
            logits = []
            for token in feed:
                logits.append(await run(runner.next_logits, seq))
                seq.tokens.append(token)
            solo.append(logits)
        base = await run(runner.start, prompt, SamplingParams())
        seqs = [base, await run(runner.copy, base), await run(runner.copy, base)]
        for step in range(len(feeds[0])):
            rows = await run(runner.next_logits_batch, seqs)
            for i, seq in enumerate(seqs):
                assert np.array_equal(rows[i], solo[i][step]), (i, step)
                seq.tokens.append(feeds[i][step])


def test_top_logprobs_breaks_ties_by_the_lower_id():
    row = np.array([-3.0, -1.0, -2.0, -1.0, -2.0, -np.inf], dtype=np.float32)
    assert top_logprobs(row, 3) == ((1, -1.0), (3, -1.0), (2, -2.0))
    assert top_logprobs(row, 0) == ()
    assert top_logprobs(row, 10) == tuple(ranked(row, 10))
