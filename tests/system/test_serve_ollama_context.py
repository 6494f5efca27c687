"""Ollama's ``options.num_ctx`` is the request's context, as Ollama takes it: a chat that
does not fit loses its oldest messages (never a system message or the last one), a prompt
still too long keeps its first 4 ids (Ollama's num_keep) and loses those after them, and
the reply ends where the context is full. JSON mode (Ollama's ``format``, OpenAI's
``response_format``) is refused with what to do instead."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from smoe.engine import Engine
from smoe.sampling import SamplingParams
from smoe.serve.app import ServerOptions
from tests.conftest import tiny_vault
from tests.serving import Running

pytestmark = pytest.mark.asyncio

LONG = " ".join(f"word{i}" for i in range(60))


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    return tiny_vault(tmp_path_factory.mktemp("ollama-ctx"), seed=11)


async def greedy(engine: Engine, ids: list[int], n: int) -> tuple[str, int]:
    tokens = [
        e.token
        async for e in engine.stream(ids, SamplingParams(temperature=0.0), n)
        if e.token is not None
    ]
    return engine.tokenizer.decode(tokens), len(tokens)


def templated(engine: Engine, messages: list[dict[str, Any]]) -> list[int]:
    return list(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


async def test_a_raw_prompt_longer_than_num_ctx_keeps_its_start_and_end(vault):
    async with Engine.open(vault.path) as engine, Running(engine, ServerOptions()) as srv:
        c = srv.ollama()
        ids = engine.encode(LONG)
        ctx = len(ids) // 2
        kept = ids[:4] + ids[len(ids) - (ctx - 1 - 4) :]  # Ollama's cut: num_keep 4
        want, n = await greedy(engine, kept, 1)  # the context holds one more token
        options = {"temperature": 0, "num_ctx": ctx, "num_predict": 50}
        r = await c.generate(model="smoe", prompt=LONG, raw=True, options=options)
        assert (r.prompt_eval_count, r.eval_count, r.response) == (ctx - 1, n, want)
        assert r.done_reason == "length"


async def test_the_reply_ends_where_num_ctx_is_full(vault):
    async with Engine.open(vault.path) as engine, Running(engine, ServerOptions()) as srv:
        c = srv.ollama()
        ids = engine.encode("In the beginning")
        ctx = len(ids) + 5
        want, n = await greedy(engine, ids, 5)
        for predict in (50, -2, None):  # more than the room, "fill the context", the default
            options = {"temperature": 0, "num_ctx": ctx, "num_predict": predict}
            r = await c.generate(model="smoe", prompt="In the beginning", raw=True, options=options)
            assert (r.prompt_eval_count, r.eval_count, r.response) == (len(ids), n, want)
        # within the room, num_predict as sent
        options = {"temperature": 0, "num_ctx": ctx, "num_predict": 2}
        r = await c.generate(model="smoe", prompt="In the beginning", raw=True, options=options)
        assert r.eval_count == min(2, n)


async def test_a_chat_longer_than_num_ctx_loses_its_oldest_messages(vault):
    async with Engine.open(vault.path) as engine, Running(engine, ServerOptions()) as srv:
        c = srv.ollama()
        system = {"role": "system", "content": "Be brief."}
        history = [
            {"role": "user", "content": LONG},
            {"role": "assistant", "content": "Yes."},
            {"role": "user", "content": "And?"},
            {"role": "assistant", "content": "No."},
            {"role": "user", "content": "Hello"},
        ]
        messages = [system, *history]
        fits = [system, *history[2:]]  # without the long first exchange
        ids = templated(engine, fits)
        assert len(templated(engine, messages)) > len(ids) + 8  # the premise
        ctx = len(ids) + 8
        want, n = await greedy(engine, ids, 8)
        options = {"temperature": 0, "num_ctx": ctx}
        r = await c.chat(model="smoe", messages=messages, options=options, stream=False)
        assert (r.prompt_eval_count, r.eval_count, r.message.content) == (len(ids), n, want)
        # the last message alone does not fit: it is cut as a prompt is
        last = [system, {"role": "user", "content": LONG}]
        whole = templated(engine, last)
        ctx = len(whole) // 2
        kept = whole[:4] + whole[len(whole) - (ctx - 5) :]
        want, n = await greedy(engine, kept, 1)
        r = await c.chat(model="smoe", messages=last, options={**options, "num_ctx": ctx})
        assert (r.prompt_eval_count, r.message.content) == (ctx - 1, want)


async def test_num_ctx_beyond_the_engine_is_the_engines_context(vault):
    async with (
        Engine.open(vault.path, max_context=64) as engine,
        Running(engine, ServerOptions()) as srv,
    ):
        c = srv.ollama()
        prompt = " ".join(f"w{i}" for i in range(40))
        ids = engine.encode(prompt)
        assert len(ids) > 64  # the premise: longer than the engine's context
        kept = ids[:4] + ids[len(ids) - 59 :]
        want, n = await greedy(engine, kept, 1)
        options = {"temperature": 0, "num_ctx": 100_000}
        r = await c.generate(model="smoe", prompt=prompt, raw=True, options=options)
        assert (r.prompt_eval_count, r.response) == (63, want)
        # without num_ctx such a prompt is refused, as before, with why
        import ollama

        with pytest.raises(ollama.ResponseError) as e:
            await c.generate(model="smoe", prompt=prompt, raw=True, options={"temperature": 0})
        assert e.value.status_code == 400 and "context" in e.value.error


async def test_json_mode_is_refused_naming_what_to_do_instead(vault):
    import ollama

    async with Engine.open(vault.path) as engine, Running(engine, ServerOptions()) as srv:
        for fmt in ("json", {"type": "object", "properties": {"a": {"type": "string"}}}):
            with pytest.raises(ollama.ResponseError) as e:
                await srv.ollama().generate(model="smoe", prompt="Hi", format=fmt)
            assert e.value.status_code == 400
            assert "'format'" in e.value.error and "tool" in e.value.error
            assert "\n" not in e.value.error
        messages = [{"role": "user", "content": "Hi"}]
        schema = {"name": "x", "schema": {"type": "object"}}
        for rf in ({"type": "json_object"}, {"type": "json_schema", "json_schema": schema}):
            with pytest.raises(openai.BadRequestError) as e2:
                await srv.client().chat.completions.create(
                    model="smoe", messages=messages, response_format=rf
                )
            err = e2.value.body
            assert err["param"] == "response_format" and "tool" in err["message"]
        ok = await srv.client().chat.completions.create(
            model="smoe", messages=messages, max_tokens=2, response_format={"type": "text"}
        )
        assert ok.choices


async def test_a_tool_result_is_never_kept_without_its_call():
    """Ollama's chatPrompt: dropping old messages never leaves a tool result whose call
    was dropped (here the result alone with the last message would fit)."""
    from smoe.serve.ollama_context import fit_chat

    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]}
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        call,
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
        {"role": "user", "content": "Then?"},
    ]

    async def template(ms):  # ten ids a message
        return [0] * (10 * len(ms)), ms

    ids, kept = await fit_chat(messages, template, 45)
    assert kept == [messages[0], messages[-1]] and len(ids) == 20
    ids, kept = await fit_chat(messages, template, 55)
    assert kept == [messages[0], *messages[2:]]
