"""A reply's text is exactly the tokenizer's own decoding of its ids (issue 51: a first
token's leading space was dropped), streamed or not, through the engine and every API of
`smoe serve`, on a ChatML (qwen3_moe) and a gpt_oss vault; stop strings cut that text.

The reference is ``tokenizer.decode(ids)`` (transformers), for ids the engine generated
greedily itself; ``TextStream`` is also checked on random ids and on other decoders."""

from __future__ import annotations

import random
from typing import Any

import pytest

from smoe.engine import Engine
from smoe.engine.requests import TextStream
from smoe.sampling import SamplingParams
from smoe.serve.app import ServerOptions
from tests.conftest import tiny_vault
from tests.serving import Running

pytestmark = pytest.mark.asyncio

PROMPTS = ["Moses was", "And God said", "Hello", "The cat", "1 2 3", "héllo wörld", "日本", "Q:"]
N = 8  # tokens per reply


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def vault(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"text-{request.param}")
    if request.param == "qwen3_moe":
        return tiny_vault(root, seed=11)
    from smoe.synth import synthesize
    from smoe.vault.convert import ConvertOptions, convert

    src = synthesize(root / "src", arch="gpt_oss", preset="tiny", seed=3)
    return convert(src, root / "v", ConvertOptions(dtype="float32"))


async def generated(engine: Engine, ids: list[int], n: int = N) -> tuple[list[int], str]:
    """The engine's greedy ids for ``ids`` and the text its events carry."""
    tokens, text = [], ""
    async for event in engine.stream(ids, SamplingParams(temperature=0.0), n):
        if event.token is not None:
            tokens.append(event.token)
        text += event.text
    return tokens, text


def chat_ids(engine: Engine, prompt: str) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    return list(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


async def test_engine_event_texts_join_to_the_decoding_of_their_ids(vault):
    async with Engine.open(vault.path) as engine:
        tok = engine.tokenizer
        spaced = 0
        for prompt in PROMPTS:
            for ids in (engine.encode(prompt), chat_ids(engine, prompt)):
                tokens, text = await generated(engine, ids, 16)
                assert text == tok.decode(tokens), prompt
                spaced += text.startswith(" ")
            # sampled too: whatever ids come, their text
            events = engine.generate(prompt, 16, temperature=1.0, seed=len(prompt))
            tokens, pieces = [], []
            async for event in events:
                tokens += [event.token] if event.token is not None else []
                pieces.append(event.text)
            assert "".join(pieces) == tok.decode(tokens), prompt
        assert spaced, "the premise: some reply starts with a space"


async def test_every_api_answers_the_decoding_of_its_ids(vault):
    async with Engine.open(vault.path) as engine, Running(engine, ServerOptions()) as srv:
        tok = engine.tokenizer
        openai, anthropic, ollama = srv.client(), srv.anthropic(), srv.ollama()
        for prompt in PROMPTS:
            raw, _ = await generated(engine, engine.encode(prompt))
            want = tok.decode(raw)
            kw: dict[str, Any] = {"model": "smoe", "max_tokens": N, "temperature": 0}
            r = await openai.completions.create(prompt=prompt, **kw)
            assert r.choices[0].text == want, prompt
            chunks = await openai.completions.create(prompt=prompt, stream=True, **kw)
            assert "".join([c.choices[0].text async for c in chunks]) == want, prompt
            options = {"temperature": 0, "num_predict": N}
            g = await ollama.generate(model="smoe", prompt=prompt, raw=True, options=options)
            assert g.response == want, prompt
            parts = await ollama.generate(
                model="smoe", prompt=prompt, raw=True, options=options, stream=True
            )
            assert "".join([p.response async for p in parts]) == want, prompt
            # a stop string inside the text: the text before it
            stop = want[2:4]
            if stop.strip():
                cut = await openai.completions.create(prompt=prompt, stop=[stop], **kw)
                assert cut.choices[0].text == want[: want.find(stop)], prompt

            reply, _ = await generated(engine, chat_ids(engine, prompt))
            want = tok.decode(reply)
            messages = [{"role": "user", "content": prompt}]
            c = await openai.chat.completions.create(messages=messages, **kw)
            assert c.choices[0].message.content == want, prompt
            chunks = await openai.chat.completions.create(messages=messages, stream=True, **kw)
            pieces = [ch.choices[0].delta.content or "" async for ch in chunks if ch.choices]
            assert "".join(pieces) == want, prompt
            akw = {"model": "smoe", "max_tokens": N, "messages": messages}
            m = await anthropic.messages.create(**akw, extra_body={"temperature": 0})
            assert "".join(b.text for b in m.content) == want, prompt
            async with anthropic.messages.stream(**akw, extra_body={"temperature": 0}) as s:
                assert "".join([t async for t in s.text_stream]) == want, prompt
            o = await ollama.chat(model="smoe", messages=messages, options=options, stream=False)
            assert o.message.content == want, prompt
            parts = await ollama.chat(model="smoe", messages=messages, options=options, stream=True)
            assert "".join([p.message.content async for p in parts]) == want, prompt


def pieces_of(tok: Any, ids: list[int]) -> str:
    stream = TextStream(tok)
    return "".join(stream.add(i) for i in ids) + stream.finish()


async def test_random_ids_stream_to_their_decoding(vault):
    """Any ids, byte tokens that split UTF-8 characters and special tokens included."""
    async with Engine.open(vault.path) as engine:
        tok = engine.tokenizer
        rng = random.Random(5)
        for _ in range(500):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 30))]
            assert pieces_of(tok, ids) == tok.decode(ids), ids
        multibyte = tok.encode("é日本語🙂 x", add_special_tokens=False)
        assert pieces_of(tok, multibyte) == "é日本語🙂 x"


def sentencepiece_like() -> Any:
    """A transformers tokenizer whose decoder drops the text's first space (Metaspace, as
    SentencePiece models'), byte fallback for unknown characters, spaces cleaned up."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    alphabet = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *alphabet])
    tok.train_from_iterator(
        ["in the beginning God created the heaven and the earth , ."] * 50, trainer
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=True)


async def test_a_sentencepiece_decoder_streams_to_its_decoding():
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    tok = TokenizerWrapper(sentencepiece_like())
    rng = random.Random(7)
    texts = ["In the beginning , God .", " the earth", "héllo 日本 ,x", "a , b . c"]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert pieces_of(tok, ids) == tok.decode(ids), text
    for _ in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 20))]
        assert pieces_of(tok, ids) == tok.decode(ids), ids
