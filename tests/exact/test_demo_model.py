"""The built-in demo has learned its language, and the engine runs it exactly.

The demo (smoe/chat/demo_model/, trained by train/demo/) is scored on held-out King James
text that neither its tokenizer nor its training saw, against a model of the same geometry
with random weights; its greedy reply is made of the book's words; and, its logits being
decisive, the engine's output equals mlx-lm's in memory bit for bit at every ring size and
transformers' (torch, float32) on the original bfloat16 weights to rounding.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from smoe.chat.demo import DEMO_SOURCE, demo_vault
from smoe.engine import Engine
from smoe.vault.format import Vault
from tests.exact.test_engine_exact import (
    DECODE_STEPS,
    engine_decode,
    engine_generate,
    reference_decode,
    reference_logits,
    reference_model,
)

DATA = Path(__file__).parents[1] / "data"
HELD_OUT = (DATA / "kjv_held_out.txt").read_text(encoding="utf-8")
# Measured (docs/demo-model.md): the demo 1.29 bits per byte on this text (perplexity 32
# per token), the random-weight demo 45.7. The bar sits far under the random model, with
# room above the demo for other BLAS builds' rounding.
MAX_BITS_PER_BYTE = 1.6
PROMPT = "Hello, who are you?"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """(vault, tokenizer): the demo converted as `smoe chat` converts it."""
    from transformers import AutoTokenizer

    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SMOE_CACHE", str(cache))
        vault = Vault.open(demo_vault())
    return vault, AutoTokenizer.from_pretrained(str(DEMO_SOURCE))


def chat_prompt(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text))


async def bits_per_byte(vault_path: Path, ids: list[int], text: str) -> float:
    """Teacher-forced cross-entropy of ``ids`` (all but the first token), in bits per byte
    of ``text``: comparable across tokenizers."""
    async with Engine.open(vault_path) as engine:
        logits = mx.array(await engine.logits(ids))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    nll = -mx.take_along_axis(logprobs[:-1], mx.array(ids[1:])[:, None], axis=-1).sum().item()
    return nll / math.log(2) / len(text.encode("utf-8"))


def tokens_of(tokenizer, text: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids("<|endoftext|>"), *tokenizer.encode(text)]


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
async def test_held_out_text_scores_far_better_than_random_weights(demo, tmp_path):
    from transformers import AutoTokenizer

    from smoe.synth import synthesize
    from smoe.vault.convert import ConvertOptions, convert

    vault, tokenizer = demo
    trained = await bits_per_byte(vault.path, tokens_of(tokenizer, HELD_OUT), HELD_OUT)
    # Random weights, the same geometry family (the `demo` synth preset) and its tokenizer.
    source = synthesize(tmp_path / "random", arch="qwen3_moe", preset="demo", seed=0)
    random_vault = convert(source, tmp_path / "rv", ConvertOptions(dtype="float32"))
    random_tok = AutoTokenizer.from_pretrained(str(source))
    head = HELD_OUT[:600]  # per byte, so a prefix compares (random: 45.7 bits, far off the bar)
    rand = await bits_per_byte(random_vault.path, tokens_of(random_tok, head), head)
    print(json.dumps({"trained_bits_per_byte": trained, "random_bits_per_byte": rand}))
    assert trained < MAX_BITS_PER_BYTE < rand / 2


@pytest.mark.asyncio
async def test_the_greedy_reply_is_made_of_the_books_words(demo):
    vault, tokenizer = demo
    words = set((DATA / "kjv_words.txt").read_text().split())
    async with Engine.open(vault.path) as engine:
        tokens = await engine_generate(engine, chat_prompt(tokenizer, PROMPT), 64)
    reply = tokenizer.decode(tokens, skip_special_tokens=True)
    said = re.findall(r"[A-Za-z]+", reply)
    assert len(said) >= 5, reply
    known = sum(w.lower() in words for w in said) / len(said)
    assert known >= 0.9, (known, reply)


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
async def test_the_demo_runs_bit_identical_to_mlx_lm_at_every_ring_size(demo, tmp_path):
    vault, tokenizer = demo
    ref = reference_model(vault, tmp_path / "mlx")
    prompt = tokens_of(tokenizer, HELD_OUT[:300]) + chat_prompt(tokenizer, PROMPT)
    want = reference_logits(ref, prompt)
    ref_tokens, ref_step_logits = reference_decode(ref, prompt, DECODE_STEPS)
    m = vault.manifest
    top_k = m.shape.experts_per_token
    for name, opts in {
        "minimum": dict(slots=top_k),
        "quarter": dict(slots=m.num_records // 4),
        "all": {},
    }.items():
        async with Engine.open(vault.path, **opts) as engine:
            assert np.array_equal(await engine.logits(prompt), want), name
            step_logits, _ = await engine_decode(engine, prompt, ref_tokens)
            for i, (a, b) in enumerate(zip(step_logits, ref_step_logits, strict=True)):
                assert np.array_equal(a, b), (name, i)
            assert await engine_generate(engine, prompt, DECODE_STEPS) == ref_tokens, name


@pytest.mark.asyncio
async def test_the_demo_agrees_with_transformers_on_the_original_weights(tmp_path):
    """An unquantized float32 vault of the shipped bfloat16 checkpoint against transformers'
    Qwen3MoeForCausalLM in float32: logits to summation-order rounding, greedy tokens equal."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from smoe.vault.convert import ConvertOptions, convert

    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_SOURCE))
    vault = convert(DEMO_SOURCE, tmp_path / "v", ConvertOptions(bits=16, dtype="float32"))
    model = AutoModelForCausalLM.from_pretrained(str(DEMO_SOURCE), dtype=torch.float32).eval()
    prompt = chat_prompt(tokenizer, PROMPT)
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0].numpy()
        ref = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=DECODE_STEPS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    async with Engine.open(vault.path) as engine:
        got = await engine.logits(prompt)
        tokens = await engine_generate(engine, prompt, DECODE_STEPS, stop_at_eos=False)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    assert tokens == ref
