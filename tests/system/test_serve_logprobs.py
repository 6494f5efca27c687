"""`smoe serve`'s log-probabilities, echo, n > 1, prompt lists and logit_bias.

The numbers are checked against mlx-lm running the same weights in memory
(tests/exact/test_logprobs.py's ``reference``), through JSON (a float32 number survives
Python's float repr exactly): lm-evaluation-harness's loglikelihood request (a list of token
prompts, ``echo``, ``logprobs`` 1, ``max_tokens`` 1, or 0) and its own parsing of the
answer; chat's ``logprobs``/``top_logprobs`` streamed and not; ``n`` > 1 (choice j: the solo
answer under seed + j); ``logit_bias`` (the tokens move, the numbers are the model's); and
the 400s of what stays refused.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from smoe.engine import Engine
from smoe.serve.app import ServerOptions
from tests.conftest import tiny_vault
from tests.exact.test_engine_exact import reference_model
from tests.exact.test_logprobs import reference
from tests.serving import Running

pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic

MESSAGES = [{"role": "user", "content": "Tell me a story"}]
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(20, 90))]  # 90: two chunks


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    return tiny_vault(tmp_path_factory.mktemp("serve-logprobs"), seed=11)


@pytest.fixture(scope="module")
def ref(vault, tmp_path_factory):
    return reference_model(vault, tmp_path_factory.mktemp("serve-logprobs-mlx") / "m")


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with http.post(url, json=body) as r:
        return r.status, await r.json()


async def events(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[Any]:
    """A streamed answer's chunks (its ``[DONE]`` checked and left out)."""
    async with http.post(url, json={**body, "stream": True}) as r:
        assert r.status == 200
        lines = [line for line in (await r.text()).split("\n") if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def parse_logprobs(out: dict[str, Any], ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-evaluation-harness 0.4's LocalCompletionsAPI.parse_logprobs, verbatim in effect:
    the continuation's summed log-probability and whether it is the greedy one."""
    res = []
    choices = sorted(out["choices"], key=lambda c: c["index"])
    for choice, ctxlen in zip(choices, ctxlens, strict=True):
        lp = choice["logprobs"]
        tokens_logprobs = lp["token_logprobs"][ctxlen:-1]
        top_logprobs = lp["top_logprobs"][ctxlen:-1]
        pairs = zip(tokens_logprobs, top_logprobs, strict=True)
        greedy = all(tok == max(top.values()) for tok, top in pairs)
        res.append((sum(tokens_logprobs), greedy))
    return res


async def test_lm_eval_loglikelihood_requests_equal_mlx_lm(vault, ref):
    async with (
        Engine.open(vault.path) as engine,
        Running(engine, ServerOptions()) as srv,
        aiohttp.ClientSession() as http,
    ):
        url = srv.base + "/v1/completions"
        tok = engine.tokenizer
        ask = {"model": "smoe", "prompt": PROMPTS, "temperature": 0, "logprobs": 1, "seed": 1234}
        status, out = await post(http, url, {**ask, "max_tokens": 1, "echo": True})
        assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1, 2]
        status, only = await post(http, url, {**ask, "max_tokens": 0, "echo": True})
        assert status == 200
        for prompt, choice, bare in zip(PROMPTS, out["choices"], only["choices"], strict=True):
            tokens, scores, prompt_scores = reference(ref, prompt, 1, k=1)
            lp = choice["logprobs"]
            want = [None] + [s.logprob for s in prompt_scores] + [scores[0].logprob]
            assert lp["token_logprobs"] == want  # the generated token too, even an EOS id
            assert lp["tokens"] == [tok.decode([t]) for t in prompt + tokens]
            for top, s in zip(lp["top_logprobs"][1:], [*prompt_scores, *scores], strict=True):
                assert top == {
                    tok.decode([s.top[0][0]]): s.top[0][1],
                    tok.decode([s.token]): s.logprob,
                }
            starts = [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
            assert lp["text_offset"] == starts
            assert choice["text"].startswith(tok.decode(prompt))
            # max_tokens 0: the prompt alone
            assert bare["logprobs"]["token_logprobs"] == want[:-1]
            assert bare["text"] == tok.decode(prompt) and bare["finish_reason"] == "length"
        assert only["usage"]["completion_tokens"] == 0
        # lm-eval's own reading: the continuation (the last 3 tokens of each) scored
        ctxlens = [max(1, len(p) - 3) for p in PROMPTS]
        got = parse_logprobs(out, ctxlens)
        for (total, greedy), prompt, ctxlen in zip(got, PROMPTS, ctxlens, strict=True):
            _, _, prompt_scores = reference(ref, prompt, 0, k=1)
            tail = prompt_scores[ctxlen - 1 :]
            assert total == sum(s.logprob for s in tail)
            assert greedy == all(s.top[0][0] == s.token for s in tail)


async def test_completions_logprobs_streamed_and_not(vault, ref):
    async with (
        Engine.open(vault.path) as engine,
        Running(engine, ServerOptions()) as srv,
        aiohttp.ClientSession() as http,
    ):
        url = srv.base + "/v1/completions"
        body = {"prompt": PROMPTS[2], "max_tokens": 8, "logprobs": 3, "temperature": 0}
        body["ignore_eos"] = True
        _, out = await post(http, url, body)
        tokens, scores, _ = reference(ref, PROMPTS[2], 8, k=3)
        lp = out["choices"][0]["logprobs"]
        assert lp["token_logprobs"] == [s.logprob for s in scores]
        assert lp["text_offset"][0] == 0  # (no echo: offsets into the reply)
        tops = [{engine.tokenizer.decode([i]): v for i, v in s.top} for s in scores]
        assert [dict(list(t.items())[:3]) for t in lp["top_logprobs"]] == tops
        chunks = await events(http, url, body)
        streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
        numbers = [x for s in streamed if s for x in s["token_logprobs"]]
        offsets = [x for s in streamed if s for x in s["text_offset"]]
        assert numbers == lp["token_logprobs"] and offsets == lp["text_offset"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == out["choices"][0]["text"]
        assert len(tokens) == 8
        # echo, streamed: the prompt's text and numbers come first
        echo = {**body, "echo": True, "max_tokens": 3}
        _, whole = await post(http, url, echo)
        chunks = await events(http, url, echo)
        assert chunks[0]["choices"][0]["text"].startswith(engine.tokenizer.decode(PROMPTS[2]))
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
        streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
        for key in ("tokens", "token_logprobs", "text_offset"):
            got = [x for s in streamed for x in s[key]]
            assert got == whole["choices"][0]["logprobs"][key], key
        assert len(got) == len(PROMPTS[2]) + 3


async def test_the_openai_client_reads_the_answers(vault):
    async with Engine.open(vault.path) as engine, Running(engine, ServerOptions()) as srv:
        c = srv.client()
        r = await c.completions.create(
            model="smoe", prompt=PROMPTS[:2], n=2, max_tokens=3, logprobs=1, echo=True, seed=1
        )
        assert [x.index for x in r.choices] == [0, 1, 2, 3]
        lp = r.choices[3].logprobs
        assert lp.token_logprobs[0] is None and len(lp.tokens) == len(PROMPTS[1]) + 3
        chat = await c.chat.completions.create(
            model="smoe", messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=2, n=2
        )
        first = chat.choices[1].logprobs.content[0]
        assert first.logprob <= 0 and len(first.top_logprobs) == 2 and first.bytes
        stream = await c.chat.completions.create(
            model="smoe", messages=MESSAGES, max_tokens=3, logprobs=True, stream=True
        )
        entries = [
            e
            for ch in [x async for x in stream]
            for e in (
                ch.choices[0].logprobs.content if ch.choices and ch.choices[0].logprobs else []
            )
        ]
        assert [e.logprob for e in entries] == [
            e.logprob for e in chat.choices[0].logprobs.content
        ][: len(entries)]


async def test_chat_logprobs_streamed_and_not(vault, ref):
    async with (
        Engine.open(vault.path) as engine,
        Running(engine, ServerOptions()) as srv,
        aiohttp.ClientSession() as http,
    ):
        url = srv.base + "/v1/chat/completions"
        ids = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "logprobs": True}
        body.update(top_logprobs=4, ignore_eos=True)
        _, out = await post(http, url, body)
        assert out["usage"]["prompt_tokens"] == len(ids)
        tokens, scores, _ = reference(ref, ids, 6, k=4)
        content = out["choices"][0]["logprobs"]["content"]
        text = engine.tokenizer.decode
        assert [e["token"] for e in content] == [text([t]) for t in tokens]
        assert [e["logprob"] for e in content] == [s.logprob for s in scores]
        assert [e["bytes"] for e in content] == [list(text([t]).encode()) for t in tokens]
        for e, s in zip(content, scores, strict=True):
            assert [(a["token"], a["logprob"]) for a in e["top_logprobs"]] == [
                (text([i]), v) for i, v in s.top
            ]
        chunks = await events(http, url, body)
        streamed = [
            e
            for c in chunks
            for e in ((c["choices"][0].get("logprobs") or {}).get("content") or [])
        ]
        assert streamed == content
        # logprobs without alternatives; and not asked: null
        _, bare = await post(http, url, {**body, "top_logprobs": 0})
        assert [e["top_logprobs"] for e in bare["choices"][0]["logprobs"]["content"]] == [[]] * 6
        _, none = await post(http, url, {"messages": MESSAGES, "max_tokens": 2})
        assert none["choices"][0]["logprobs"] is None


async def test_n_choices_equal_their_solo_runs(vault):
    """Choice j of n is the solo answer under seed + j, prompts and choices batched
    together, streamed or not; greedy choices are all the same answer."""
    async with (
        Engine.open(vault.path) as engine,
        Running(engine, ServerOptions()) as srv,
        aiohttp.ClientSession() as http,
    ):
        url = srv.base + "/v1/completions"
        base = {"max_tokens": 10, "temperature": 1.2, "ignore_eos": True, "logprobs": 2}
        solo = {}
        for p, prompt in enumerate(PROMPTS[:2]):
            for j in range(3):
                _, one = await post(http, url, {**base, "prompt": prompt, "seed": 40 + j})
                solo[p * 3 + j] = one["choices"][0]
        _, many = await post(http, url, {**base, "prompt": PROMPTS[:2], "n": 3, "seed": 40})
        assert many["usage"]["prompt_tokens"] == len(PROMPTS[0]) + len(PROMPTS[1])
        assert many["usage"]["completion_tokens"] == 60
        texts = set()
        for choice in many["choices"]:
            want = solo[choice["index"]]
            assert choice["text"] == want["text"] and choice["logprobs"] == want["logprobs"]
            texts.add(choice["text"])
        assert len(texts) > 2  # the seeds differ
        chunks = await events(http, url, {**base, "prompt": PROMPTS[:2], "n": 3, "seed": 40})
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == many["usage"]
        for i in range(6):
            mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == i]
            assert "".join(c["text"] for c in mine) == solo[i]["text"]
            assert mine[-1]["finish_reason"] == "length"
        # chat, greedy: every choice the same answer
        chat = {"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "n": 2}
        _, two = await post(http, srv.base + "/v1/chat/completions", chat)
        a, b = (c["message"]["content"] for c in two["choices"])
        assert a == b and [c["index"] for c in two["choices"]] == [0, 1]
        # echo with n > 1: each choice starts with the prompt's numbers, computed once
        _, echoed = await post(
            http, url, {**base, "prompt": PROMPTS[1], "n": 2, "echo": True, "seed": 40}
        )
        firsts = [c["logprobs"]["token_logprobs"][:3] for c in echoed["choices"]]
        assert firsts[0] == firsts[1] and firsts[0][0] is None
        assert engine.stats().batch.mean_rows_per_step > 1


async def test_logit_bias_moves_the_tokens_not_the_numbers(vault, ref):
    async with (
        Engine.open(vault.path) as engine,
        Running(engine, ServerOptions()) as srv,
        aiohttp.ClientSession() as http,
    ):
        url = srv.base + "/v1/completions"
        prompt = PROMPTS[0]
        plain, _, _ = reference(ref, prompt, 1, k=1)
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 1}
        bias = {str(plain[0]): -100, "40": 7.5}
        _, out = await post(http, url, {**body, "logit_bias": bias, "ignore_eos": True})
        want, scores, _ = reference(ref, prompt, 4, k=1, bias={plain[0]: -100.0, 40: 7.5})
        lp = out["choices"][0]["logprobs"]
        assert lp["tokens"] == [engine.tokenizer.decode([t]) for t in want]
        assert lp["token_logprobs"] == [s.logprob for s in scores]  # the model's own
        assert want[0] != plain[0]


REFUSED = [
    ("chat", {"top_logprobs": 3}, "top_logprobs", "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "0 and 20"),
    ("chat", {"logprobs": 2}, "logprobs", "boolean"),
    ("completions", {"logprobs": 6}, "logprobs", "0 and 5"),
    ("completions", {"logprobs": True}, "logprobs", "integer"),
    ("completions", {"max_tokens": 0}, "max_tokens", "echo"),
    ("chat", {"max_tokens": 0}, "max_tokens", "between 1"),
    ("completions", {"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ("completions", {"logit_bias": {"999999": 1}}, "logit_bias", "token ids"),
    ("completions", {"logit_bias": {"5": 101}}, "logit_bias.5", "-100 and 100"),
    ("completions", {"logit_bias": {"5": "1"}}, "logit_bias.5", "number"),
    ("completions", {"logit_bias": [1]}, "logit_bias", "object"),
    ("completions", {"n": 129}, "n", "128"),
    ("completions", {"n": 65, "prompt": [[5], [6]]}, "n", "128"),
    ("completions", {"prompt": [[5], []]}, "prompt[1]", "empty"),
    ("completions", {"prompt": [[5], ["a"]]}, "prompt[1][0]", "token id"),
    ("completions", {"best_of": 2}, "best_of", "1"),
]


async def test_what_stays_refused_gets_a_400_naming_the_field(vault):
    async with (
        Engine.open(vault.path) as engine,
        Running(engine, ServerOptions()) as srv,
        aiohttp.ClientSession() as http,
    ):
        for path, extra, param, needle in REFUSED:
            body: dict[str, Any] = {"max_tokens": 2}
            if path == "chat":
                url, body["messages"] = srv.base + "/v1/chat/completions", MESSAGES
            else:
                url, body["prompt"] = srv.base + "/v1/completions", [5, 6]
            status, out = await post(http, url, {**body, **extra})
            assert status == 400, (extra, out)
            error = out["error"]
            assert error["param"] == param and needle in error["message"], (extra, error)
            assert "\n" not in error["message"]
