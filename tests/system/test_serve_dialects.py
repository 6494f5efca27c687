"""`smoe serve`'s Anthropic and Ollama APIs, with their real clients, on a real engine.

The anthropic SDK (2.x) has no ``temperature`` argument any more; the API still takes the
field, so greedy requests send it as ``extra_body``.

Every reply must be the engine's own greedy reply to the same prompt (the chat template's
ids, or the raw prompt's), whatever the API: exactness across dialects. Errors come back
in each API's own shape and status.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import anthropic
import ollama
import pytest

from smoe.engine import Engine
from smoe.sampling import SamplingParams
from smoe.serve.app import ServerOptions
from tests.conftest import tiny_vault
from tests.serving import Running

pytestmark = pytest.mark.asyncio

SYSTEM = "Be brief."
USER = "Hello"
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    return tiny_vault(tmp_path_factory.mktemp("dialects"), seed=11)


async def greedy(engine: Engine, ids: list[int], n: int) -> tuple[str, int, str]:
    """The engine's own greedy reply to ``ids``: (text, tokens, finish_reason)."""
    text, count, finish = "", 0, ""
    async for event in engine.stream(ids, SamplingParams(temperature=0.0), n):
        text += event.text
        count += event.token is not None
        finish = event.finish_reason or finish
    return text, count, finish


def templated(engine: Engine, messages: list[dict[str, Any]]) -> list[int]:
    return list(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


async def test_anthropic_messages_equal_the_engine_plain_and_streamed(vault):
    async with Engine.open(vault.path) as engine, Running(engine, ServerOptions()) as srv:
        ids = templated(engine, MESSAGES)
        want, count, finish = await greedy(engine, ids, 12)
        c = srv.anthropic()
        kw: dict[str, Any] = {
            "model": "smoe",
            "max_tokens": 12,
            "extra_body": GREEDY,
            "system": SYSTEM,
            "messages": [{"role": "user", "content": USER}],
        }
        m = await c.messages.create(**kw)
        assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
        assert [b.type for b in m.content] == ["text"] and m.content[0].text == want
        assert m.usage.input_tokens == len(ids) and m.usage.output_tokens == count
        assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[finish]
        assert m.stop_sequence is None

        # system as blocks, content as blocks: the same prompt
        blocks = await c.messages.create(
            **{
                **kw,
                "system": [{"type": "text", "text": SYSTEM}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": USER}]}],
            }
        )
        assert blocks.content[0].text == want

        async with c.messages.stream(**kw) as stream:
            pieces = [t async for t in stream.text_stream]
            final = await stream.get_final_message()
        assert "".join(pieces) == want and final.content[0].text == want
        assert final.usage.output_tokens == count and final.stop_reason == m.stop_reason

        # and OpenAI's route gives the same reply to the same messages
        o = await srv.client().chat.completions.create(
            model="smoe", messages=MESSAGES, max_tokens=12, temperature=0
        )
        assert o.choices[0].message.content == want and o.usage.prompt_tokens == len(ids)

        counted = await c.messages.count_tokens(
            model="smoe", system=SYSTEM, messages=kw["messages"]
        )
        assert counted.input_tokens == len(ids)


async def test_anthropic_event_sequence_and_stop_sequences(vault):
    async with (
        Engine.open(vault.path) as engine,
        Running(engine, ServerOptions()) as srv,
        aiohttp.ClientSession() as http,
    ):
        ids = templated(engine, MESSAGES)
        want, _, _ = await greedy(engine, ids, 12)
        body = {
            "model": "smoe",
            "max_tokens": 12,
            "temperature": 0,
            "system": SYSTEM,
            "messages": [{"role": "user", "content": USER}],
            "stream": True,
        }
        async with http.post(srv.base + "/v1/messages", json=body) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            raw = (await r.read()).decode()
        events = [e for e in raw.split("\n\n") if e]
        names = [e.split("\n")[0].removeprefix("event: ") for e in events]
        datas = [json.loads(e.split("\n")[1].removeprefix("data: ")) for e in events]
        assert [d["type"] for d in datas] == names  # each event's name is its data's type
        assert names[:3] == ["message_start", "content_block_start", "ping"]
        assert set(names[3:-3]) == {"content_block_delta"}
        assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        assert "".join(d["delta"]["text"] for d in datas[3:-3]) == want

        # a stop sequence cuts the reply before it and is named
        cut = want[len(want) // 2 :][:3]
        assert cut and cut in want
        m = await srv.anthropic().messages.create(
            model="smoe",
            max_tokens=12,
            extra_body=GREEDY,
            system=SYSTEM,
            messages=[{"role": "user", "content": USER}],
            stop_sequences=[cut],
        )
        assert m.content[0].text == want[: want.index(cut)]
        assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", cut)


async def test_anthropic_errors_and_keys_and_ollama_keys(vault):
    options = ServerOptions(api_key="secret")
    async with (
        Engine.open(vault.path) as engine,
        Running(engine, options) as srv,
        aiohttp.ClientSession() as http,
    ):
        ok = await srv.anthropic().messages.create(
            model="smoe", max_tokens=2, messages=[{"role": "user", "content": USER}]
        )  # the key as x-api-key
        assert ok.usage.output_tokens >= 1
        with pytest.raises(anthropic.AuthenticationError):
            await srv.anthropic("wrong").messages.create(
                model="smoe", max_tokens=2, messages=[{"role": "user", "content": USER}]
            )
        with pytest.raises(anthropic.BadRequestError, match="temperature"):
            await srv.anthropic().messages.create(
                model="smoe",
                max_tokens=2,
                extra_body={"temperature": 1.5},  # Anthropic's range is 0 to 1
                messages=[{"role": "user", "content": USER}],
            )
        key = {"x-api-key": "secret"}
        cases = [
            ("/v1/messages", {"messages": [{"role": "user", "content": USER}]}, 400, "max_tokens"),
            ("/v1/messages", {"max_tokens": 2, "messages": []}, 400, "messages"),
            (
                "/v1/messages",
                {"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
                400,
                "content[0].type",
            ),
            ("/v1/messages/nope", {}, 404, "no such endpoint"),
        ]
        for path, body, status, needle in cases:
            async with http.post(srv.base + path, json=body, headers=key) as r:
                got = await r.json()
                assert r.status == status, (body, got)
                assert got["type"] == "error" and needle in got["error"]["message"]
                kind = "not_found_error" if status == 404 else "invalid_request_error"
                assert got["error"]["type"] == kind
        bad_json = {**key, "Content-Type": "application/json"}
        async with http.post(srv.base + "/v1/messages", data=b"{", headers=bad_json) as r:
            assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
        async with http.post(srv.base + "/v1/messages", json={}) as r:  # no key
            assert r.status == 401
            assert (await r.json())["error"]["type"] == "authentication_error"
        # Ollama's client sends the key as a Bearer header, as OpenAI's does
        listed = await srv.ollama(Authorization="Bearer secret").list()
        assert [m.model for m in listed.models] == ["smoe"]
        with pytest.raises(ollama.ResponseError) as e:
            await srv.ollama().list()
        assert e.value.status_code == 401 and "API key" in e.value.error


async def test_ollama_chat_and_generate_equal_the_engine(vault):
    async with Engine.open(vault.path) as engine, Running(engine, ServerOptions()) as srv:
        c = srv.ollama()
        options = {"temperature": 0, "num_predict": 10}
        ids = templated(engine, MESSAGES)
        want, count, finish = await greedy(engine, ids, 10)

        r = await c.chat(model="smoe", messages=MESSAGES, options=options, stream=False)
        assert r.message.role == "assistant" and r.message.content == want
        assert r.done and r.done_reason == finish
        assert (r.prompt_eval_count, r.eval_count) == (len(ids), count)
        assert r.total_duration >= r.eval_duration > 0 and r.load_duration == 0

        parts = [
            p
            async for p in await c.chat(
                model="smoe", messages=MESSAGES, options=options, stream=True
            )
        ]
        assert "".join(p.message.content for p in parts) == want
        assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
        assert parts[-1].done_reason == finish and parts[-1].eval_count == count

        # /api/generate: the prompt through the template, or raw
        ids = templated(engine, [{"role": "user", "content": USER}])
        want, count, _ = await greedy(engine, ids, 10)
        g = await c.generate(model="smoe", prompt=USER, options=options)
        assert g.response == want and g.prompt_eval_count == len(ids) and g.eval_count == count
        pieces = [
            p.response
            async for p in await c.generate(model="smoe", prompt=USER, options=options, stream=True)
        ]
        assert "".join(pieces) == want
        raw_ids = engine.encode(USER)
        want, _, _ = await greedy(engine, raw_ids, 10)
        raw = await c.generate(model="smoe", prompt=USER, raw=True, options=options)
        assert raw.response == want and raw.prompt_eval_count == len(raw_ids)

        listed = await c.list()
        assert [m.model for m in listed.models] == ["smoe"] and listed.models[0].size > 0
        shown = await c.show("smoe")
        assert shown.capabilities == ["completion"]  # this model calls no tools


async def test_ollama_options_and_errors(vault):
    async with (
        Engine.open(vault.path) as engine,
        Running(engine, ServerOptions()) as srv,
        aiohttp.ClientSession() as http,
    ):
        c = srv.ollama()
        ids = templated(engine, MESSAGES)
        want, _, _ = await greedy(engine, ids, 10)
        cut = want[len(want) // 2 :][:3]
        r = await c.chat(
            model="smoe",
            messages=MESSAGES,
            options={"temperature": 0, "num_predict": 10, "stop": [cut]},
            stream=False,
        )
        assert r.message.content == want[: want.index(cut)] and r.done_reason == "stop"
        seeded = [
            (
                await c.chat(
                    model="smoe",
                    messages=MESSAGES,
                    options={"seed": 7, "num_predict": 6},
                    stream=False,
                )
            ).message.content
            for _ in range(2)
        ]
        assert seeded[0] == seeded[1]  # seeded sampling repeats

        with pytest.raises(ollama.ResponseError) as e:
            await c.chat(model="smoe", messages=MESSAGES, options={"temperature": 5})
        assert e.value.status_code == 400 and "options.temperature" in e.value.error
        for path, body, status, needle in [
            ("/api/chat", {"model": "smoe"}, 400, "messages"),
            ("/api/chat", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
            ("/api/generate", {"prompt": "x", "options": {"top_k": "many"}}, 400, "options.top_k"),
            ("/api/generate", {"prompt": "x", "format": "json"}, 400, "format"),
            ("/api/nope", {}, 404, "no such endpoint"),
        ]:
            async with http.post(srv.base + path, json=body) as r:
                got = await r.json()
                assert r.status == status and list(got) == ["error"], (body, got)
                assert needle in got["error"]
        async with http.get(srv.base + "/api/version") as r:
            assert "version" in await r.json()


async def test_a_model_without_tools_refuses_them_in_every_dialect(vault):
    async with (
        Engine.open(vault.path) as engine,
        Running(engine, ServerOptions()) as srv,
        aiohttp.ClientSession() as http,
    ):
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        anthropic_tool = {"name": "f", "input_schema": {"type": "object"}}
        user = [{"role": "user", "content": USER}]
        for path, body, message in [
            (
                "/v1/chat/completions",
                {"messages": user, "tools": [tool]},
                lambda j: j["error"]["message"],
            ),
            (
                "/v1/messages",
                {"max_tokens": 2, "messages": user, "tools": [anthropic_tool]},
                lambda j: j["error"]["message"],
            ),
            ("/api/chat", {"messages": user, "tools": [tool]}, lambda j: j["error"]),
        ]:
            async with http.post(srv.base + path, json=body) as r:
                assert r.status == 400, path
                assert "cannot call tools" in message(await r.json())
        # tool_choice "none": the tools are not used, so the request is served
        r = await srv.client().chat.completions.create(
            model="smoe", messages=user, tools=[tool], tool_choice="none", max_tokens=2
        )
        assert r.choices[0].finish_reason in ("stop", "length")


VALID = {
    "/v1/messages": {
        "max_tokens": 2,
        "system": [{"type": "text", "text": "x"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}]},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"k": 1}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}],
            },
        ],
        "stop_sequences": ["zz"],
        "top_k": 3,
    },
    "/api/chat": {
        "messages": [
            {"role": "user", "content": "a"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "f", "arguments": {}}}],
            },
            {"role": "tool", "content": "r", "tool_name": "f"},
        ],
        "options": {"num_predict": 2, "stop": ["zz"], "top_k": 3, "seed": 1},
        "stream": False,
    },
    "/api/generate": {"prompt": "a", "system": "s", "options": {"num_predict": 2}, "stream": False},
}
POOL = [
    None,
    True,
    0,
    -1,
    1.5,
    2**64,
    "",
    "x",
    [],
    [1],
    ["a"],
    [{}],
    {},
    {"type": "text"},
    {"role": "user"},
]


def mutate(rng: Any, value: Any, depth: int = 0) -> Any:
    """``value`` with one random leaf, key or element replaced, dropped or added."""
    if isinstance(value, dict) and value and depth < 4 and rng.random() < 0.8:
        key = rng.choice(list(value))
        op = rng.randrange(3)
        if op == 0:
            return {k: v for k, v in value.items() if k != key}
        if op == 1:
            return {**value, key: rng.choice(POOL)}
        return {**value, key: mutate(rng, value[key], depth + 1)}
    if isinstance(value, list) and value and depth < 4 and rng.random() < 0.8:
        i = rng.randrange(len(value))
        return [*value[:i], mutate(rng, value[i], depth + 1), *value[i + 1 :]]
    return rng.choice(POOL)


async def test_malformed_anthropic_and_ollama_requests_get_a_4xx_in_their_shape(vault, caplog):
    """Seeded mutations of valid bodies: never a 5xx, and every error in the route's shape."""
    import random

    rng = random.Random(17)
    async with (
        Engine.open(vault.path, max_context=64) as engine,
        Running(engine, ServerOptions()) as srv,
        aiohttp.ClientSession() as http,
    ):
        statuses: dict[int, int] = {}
        for i in range(120):
            path = list(VALID)[i % len(VALID)]
            body = mutate(rng, VALID[path])
            async with http.post(srv.base + path, json=body) as r:
                raw = await r.read()
            statuses[r.status] = statuses.get(r.status, 0) + 1
            assert r.status < 500, (path, body, raw)
            if r.status >= 400:
                got = json.loads(raw)
                if path == "/v1/messages":
                    assert got["type"] == "error" and got["error"]["message"], body
                else:
                    assert list(got) == ["error"] and isinstance(got["error"], str), body
        assert statuses.get(200, 0) > 10 and statuses.get(400, 0) > 20  # both kinds were sent
    assert not [rec for rec in caplog.records if rec.levelname == "ERROR"]


async def test_a_failing_generation_is_reported_in_each_dialect(vault):
    """The disk failing mid-request: a 503 in the route's shape, or, once streaming, the
    API's own error event last (Anthropic's ``event: error``, Ollama's ``{"error"}`` line),
    naming a request id and not the error."""
    from tests.fakes import FailingReads

    async with (
        Engine.open(vault.path, slots=4) as engine,
        Running(engine, ServerOptions()) as srv,
        aiohttp.ClientSession() as http,
    ):
        disk = engine.debug.scheduler.wrap_backend(FailingReads)
        disk.failing = True
        user = [{"role": "user", "content": USER}]
        anthropic_body = {"max_tokens": 3, "messages": user}
        async with http.post(srv.base + "/v1/messages", json=anthropic_body) as r:
            got = await r.json()
            assert r.status == 503 and got["error"]["type"] == "overloaded_error"
            assert r.headers["X-Request-Id"] in got["error"]["message"]
        async with http.post(
            srv.base + "/v1/messages", json={**anthropic_body, "stream": True}
        ) as r:
            events = (await r.read()).decode().strip().split("\n\n")
        assert events[0].startswith("event: message_start")
        assert events[-1].startswith("event: error\ndata: ") and "disk gone" not in events[-1]
        assert json.loads(events[-1].split("data: ")[1])["error"]["type"] == "overloaded_error"

        async with http.post(srv.base + "/api/chat", json={"messages": user, "stream": False}) as r:
            got = await r.json()
            assert r.status == 503 and r.headers["X-Request-Id"] in got["error"]
        with pytest.raises(ollama.ResponseError) as e:
            async for _ in await srv.ollama().chat(model="smoe", messages=user, stream=True):
                pass
        assert "request id" in e.value.error and "disk gone" not in e.value.error
        disk.failing = False
        ok = await srv.ollama().chat(model="smoe", messages=user, options={"num_predict": 2})
        assert ok.done
