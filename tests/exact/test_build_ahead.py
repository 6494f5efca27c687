"""Decode built one step ahead (Runner.step on a resident model) changes the order of work,
never a token or a cache entry: against the same runner stepping one pass at a time, on
mlx-lm's own in-memory model (random weights, float32, CPU)."""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import qwen3_moe

from smoe.compute.rowwise import install_rowwise_attention
from smoe.compute.runner import Runner
from smoe.sampling import SamplingParams

PROMPT = [5, 9, 31, 7, 64, 2, 17, 88, 40, 3]


def make_model():
    args = qwen3_moe.ModelArgs(
        model_type="qwen3_moe",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        rms_norm_eps=1e-6,
        vocab_size=128,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        norm_topk_prob=True,
    )
    mx.random.seed(0)
    m = qwen3_moe.Model(args)
    # decisive logits: scale the head so that sampling is not a coin toss
    m.lm_head.weight = m.lm_head.weight * 8
    mx.eval(m.parameters())
    return m


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def batch_model():
    """The same weights with per-row attention: a runner on it decodes batches."""
    m = make_model()
    assert install_rowwise_attention(m, "qwen3_moe")
    return m


@contextmanager
def broken(runner: Runner):
    """``runner``'s model fails every pass (as a lost device would) while inside."""
    real = runner.model

    class Broken:
        layers = real.layers  # (the runner makes fresh caches from them)

        def __call__(self, *a, **k):
            raise RuntimeError("device lost")

    runner.model = Broken()
    try:
        yield
    finally:
        runner.model = real


def runners(model) -> tuple[Runner, Runner]:
    """(one pass at a time, built ahead)."""
    return Runner(model), Runner(model, resident=lambda: True)


def run(runner: Runner, steps: int, params: SamplingParams, last_more: bool = True):
    seq = runner.start(PROMPT, params)
    out = [runner.step(seq, more=(i < steps - 1) or last_more) for i in range(steps)]
    return seq, out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.9, seed=11),
        SamplingParams(temperature=1.2, top_k=5, seed=3),
    ],
    ids=["greedy", "seeded", "top_k"],
)
def test_tokens_and_next_logits_are_the_same_bits(model, params):
    plain, ahead = runners(model)
    seq_a, want = run(plain, 12, params)
    seq_b, got = run(ahead, 12, params)
    assert got == want
    assert ahead.built_ahead == 12 and plain.built_ahead == 0
    assert seq_b.ahead is not None  # a pass was left queued: settled by the next use
    assert np.array_equal(ahead.next_logits(seq_b), plain.next_logits(seq_a))
    assert seq_b.ahead is None
    assert [c.offset for c in seq_b.cache] == [c.offset for c in seq_a.cache]


def test_the_last_step_builds_nothing_ahead(model):
    _, ahead = runners(model)
    seq, _ = run(ahead, 4, SamplingParams(), last_more=False)
    assert seq.ahead is None and ahead.built_ahead == 3
    assert all(c.offset == len(seq.tokens) - 1 for c in seq.cache)


def test_a_follow_up_turn_after_a_pass_built_ahead_reuses_exactly_the_prefix(model):
    """The stop came while a pass was queued (as at an EOS): the next turn's prepare drops
    it, keeps the shared prefix, and gives the logits of a fresh run on the whole stream."""
    plain, ahead = runners(model)
    seq, _ = run(ahead, 6, SamplingParams())
    follow = [*seq.tokens, 12, 13, 14]
    ran = ahead.extend(seq, follow, SamplingParams())
    assert ran == 3  # the reply's last token and the new turn but its last token
    fresh = plain.start(follow, SamplingParams())
    assert np.array_equal(ahead.next_logits(seq), plain.next_logits(fresh))


def test_a_second_row_joining_the_batch_and_a_copy_see_the_settled_sequence(model):
    plain, ahead = runners(model)
    seq_a, _ = run(plain, 5, SamplingParams())
    seq_b, _ = run(ahead, 5, SamplingParams())
    twin = ahead.copy(seq_b)  # settles: the copy holds no pass built ahead
    ahead.prepare(twin, twin.tokens, SamplingParams())
    assert seq_b.ahead is None and twin.ahead is None
    assert twin.tokens == seq_b.tokens and twin.cached == seq_b.cached
    for _ in range(3):  # two rows step together (one at a time here: not batchable)
        b = ahead.step_batch([seq_b, twin])
        assert b == [plain.step(seq_a)] * 2


def test_processors_read_the_history_on_the_host_so_nothing_is_built_ahead(model):
    _, ahead = runners(model)
    seq, _ = run(ahead, 3, SamplingParams(repetition_penalty=1.3))
    assert ahead.built_ahead == 0 and seq.ahead is None


def test_a_failed_pass_built_ahead_resets_the_sequence(model):
    _, ahead = runners(model)
    seq, _ = run(ahead, 2, SamplingParams())
    with broken(ahead), pytest.raises(RuntimeError):
        ahead.step(seq)
    assert seq.ahead is None and seq.cached == 0 and seq.to_prefill() == len(seq.tokens) - 1


# Batched decode built ahead (Runner.step_batch on a resident model): each row's tokens are
# those it gets stepping alone, one pass at a time, whatever joins or leaves the batch.

PROMPTS = [PROMPT, [3, 1, 4, 1, 5, 9, 2, 6], [70, 71], [8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 1]]


def solo_tokens(model, prompt, steps: int, params: SamplingParams) -> list[int]:
    plain = Runner(model)
    seq = plain.start(prompt, params)
    return [plain.step(seq) for _ in range(steps)]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(temperature=0.9, seed=11)],
    ids=["greedy", "seeded"],
)
def test_a_batch_built_ahead_gives_each_row_its_solo_tokens(batch_model, params):
    want = [solo_tokens(batch_model, p, 8, params) for p in PROMPTS]
    ahead = Runner(batch_model, batchable=True, resident=lambda: True)
    seqs = [ahead.start(p, params) for p in PROMPTS]
    got = [ahead.step_batch(seqs) for _ in range(8)]
    assert [list(col) for col in zip(*got, strict=True)] == want
    assert ahead.built_ahead == 8  # every step queued the next before reading its own
    assert all(s.ahead is not None and s.ahead_pass is seqs[0].ahead_pass for s in seqs)


def test_rows_leaving_and_joining_a_batch_built_ahead_keep_their_solo_tokens(batch_model):
    """Rows leave (the pass built ahead serves the rest), a row steps alone on its row of
    that pass, and a row joins (the batch runs afresh): each row's stream stays solo."""
    params = SamplingParams()
    want = [solo_tokens(batch_model, p, 12, params) for p in PROMPTS]
    ahead = Runner(batch_model, batchable=True, resident=lambda: True)
    a, b, c, d = (ahead.start(p, params) for p in PROMPTS)
    for _ in range(3):
        ahead.step_batch([a, b, c])
    for _ in range(3):
        ahead.step_batch([a, b])  # c left; a and b go on with the pass built ahead
    ahead.step(c)  # c alone, on its row of the pass built three steps ago
    for _ in range(3):
        ahead.step_batch([a, b, d])  # d joins: the first of these runs afresh
    for s in (c, c, d, d, d, d, d, d):
        ahead.step(s)
    for _ in range(3):
        ahead.step_batch([a, b, c])
    steps = (12, 12, 9, 9)  # a and b: every round; c: 3 + 3 alone + 3; d: 3 + 6 alone
    for s, prompt, solo, n in zip((a, b, c, d), PROMPTS, want, steps, strict=True):
        assert s.tokens[len(prompt) :] == solo[:n]
    for s in (a, b, c, d):  # no pass left queued in a cache once settled
        ahead.settle(s)
        assert all(layer.offset == len(s.tokens) - 1 for layer in s.cache)


def test_a_batch_not_stepped_again_builds_nothing_ahead(batch_model):
    ahead = Runner(batch_model, batchable=True, resident=lambda: True)
    seqs = [ahead.start(p, SamplingParams()) for p in PROMPTS[:2]]
    ahead.step_batch(seqs, more=False)
    assert ahead.built_ahead == 0 and all(s.ahead is None for s in seqs)


def test_a_failed_batch_built_ahead_resets_every_row(batch_model):
    ahead = Runner(batch_model, batchable=True, resident=lambda: True)
    seqs = [ahead.start(p, SamplingParams()) for p in PROMPTS[:3]]
    ahead.step_batch(seqs)
    with broken(ahead), pytest.raises(RuntimeError):
        ahead.step_batch(seqs)
    assert all(s.ahead is None and s.ahead_pass is None and s.cached == 0 for s in seqs)
