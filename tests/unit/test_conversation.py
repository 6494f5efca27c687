"""Conversations keep their KV cache; the REPL drives them (prompt_toolkit pipe input)."""

from __future__ import annotations

import asyncio
import io
import os
import signal

import numpy as np
import pytest

from smoe.compute.worker import RESIDENT
from smoe.engine import Engine
from smoe.errors import SmoeError
from smoe.synth import synthesize
from smoe.util.tokens import common_prefix
from smoe.vault.convert import ConvertOptions, convert

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    src = synthesize(root / "src", arch="qwen3_moe", preset="tiny", seed=3)
    return convert(src, root / "v", ConvertOptions(dtype="float32"))


async def reply(conv, text, **kw):
    out = []
    last = None
    async for ev in conv.send(text, **kw):
        out.append(ev.text)
        last = ev
    return "".join(out), last.stats


async def test_follow_up_prefills_only_what_is_new(vault):
    async with Engine.open(vault.path) as engine:
        conv = engine.conversation(system="You are terse.")
        _, s1 = await reply(conv, "Tell me about the sea " * 8, max_tokens=12)
        assert s1.prefilled_tokens == s1.prompt_tokens - 1  # the last one runs in the step
        stream = conv.tokens
        prompt2 = conv.template([*conv.messages, {"role": "user", "content": "More."}])
        engine.debug.tracer.counters.calls.clear()
        _, s2 = await reply(conv, "More.", max_tokens=1)
        # The reply's last token was sampled but never run: it is not in the cache yet.
        reused = min(common_prefix(stream, prompt2), len(stream) - 1)
        assert s2.prompt_tokens == len(prompt2)
        assert s2.prefilled_tokens == len(prompt2) - 1 - reused
        assert reused >= s1.prompt_tokens  # the whole first prompt is reused
        # Counted independently: tokens the first MoE layer saw in this turn.
        first_layer = vault.manifest.layers[0].layer
        seen = sum(t.tokens for t in engine.debug.tracer.counters.calls if t.layer == first_layer)
        assert seen == s2.prefilled_tokens + 1  # + the step that sampled the reply


async def make_resident(engine: Engine) -> None:
    """Read every expert, then let the next reservation pin them all for good (decode is
    then built a step ahead: Runner.step)."""
    m = engine.vault.manifest
    for spec in m.layers:
        engine.debug.scheduler.release(
            await engine.debug.scheduler.acquire(spec.layer, range(m.num_experts))
        )
    await engine.logits([1, 2])
    assert engine.debug.scheduler.holders() == {RESIDENT: m.num_records}


@pytest.mark.parametrize("slots", [6, None], ids=["streaming", "resident"])
async def test_cancelled_reply_then_next_turn_equals_a_fresh_conversation(vault, slots, tmp_path):
    """Cancelled mid-reply (as an EOS would end it), a resident model has the next pass
    already queued: the next turn, a save and a load all see the reply as it was sent."""
    async with Engine.open(vault.path, slots=slots) as engine:
        if slots is None:
            await make_resident(engine)
        conv = engine.conversation()
        await reply(conv, "Hello there, friend.", max_tokens=8)
        n = 0
        async for ev in conv.send("Say more, at length.", max_tokens=200):
            n += ev.token is not None
            if n == 3:
                break  # cancel the reply after 3 tokens
        assert conv.messages[-1]["role"] == "assistant"  # the partial reply is kept
        assert (engine.debug.runner.built_ahead > 0) == (slots is None)
        path = await conv.save(tmp_path / "chat")
        got = await conv.next_logits("Go on.")
        fresh = engine.conversation()
        fresh.messages = [dict(m) for m in conv.messages]
        assert np.array_equal(got, await fresh.next_logits("Go on."))
        loaded = await engine.load_conversation(path)
        assert np.array_equal(got, await loaded.next_logits("Go on."))
        assert set(engine.debug.scheduler.holders()) <= {RESIDENT}  # no request holds a slot


async def test_save_load_fork(vault, tmp_path):
    async with Engine.open(vault.path) as engine:
        conv = engine.conversation(system="sys")
        await reply(conv, "First question?", max_tokens=6)
        twin = await conv.fork()
        path = await conv.save(tmp_path / "chat")
        assert path.name == "chat.safetensors" and not list(tmp_path.glob(".*"))
        expected = await conv.next_logits("Second?")
        loaded = await engine.load_conversation(path)
        assert loaded.messages == conv.messages
        assert np.array_equal(await loaded.next_logits("Second?"), expected)
        await reply(conv, "Something else entirely.", max_tokens=4)  # the fork is unaffected
        assert np.array_equal(await twin.next_logits("Second?"), expected)

        (tmp_path / "junk.safetensors").write_bytes(b"not a cache")
        with pytest.raises(SmoeError, match="not a readable conversation"):
            await engine.load_conversation(tmp_path / "junk.safetensors")
        with pytest.raises(SmoeError, match="does not exist"):
            await engine.load_conversation(tmp_path / "nope.safetensors")


async def test_conversation_from_another_vault_is_refused(vault, tmp_path):
    other = convert(
        synthesize(tmp_path / "o", arch="qwen3_moe", preset="tiny", seed=4),
        tmp_path / "ov",
        ConvertOptions(dtype="float32"),
    )
    async with Engine.open(vault.path) as engine:
        conv = engine.conversation()
        await reply(conv, "Hi", max_tokens=2)
        path = await conv.save(tmp_path / "c.safetensors")
    async with Engine.open(other.path) as engine:
        with pytest.raises(SmoeError, match="another model"):
            await engine.load_conversation(path)


async def test_context_overflow_says_reset(vault):
    async with Engine.open(vault.path, max_context=80) as engine:
        conv = engine.conversation()
        with pytest.raises(SmoeError, match="/reset"):
            await reply(conv, "word " * 100, max_tokens=4)
        assert conv.messages == []  # the refused turn left no trace


async def test_repl_two_turns_a_cancel_and_reset(vault):
    from prompt_toolkit.application import create_app_session
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    from smoe.chat.repl import ChatApp

    out = io.StringIO()
    async with Engine.open(vault.path) as engine:
        with create_pipe_input() as pipe, create_app_session(input=pipe, output=DummyOutput()):
            app = ChatApp(engine, engine.conversation(), out=out, sampling={"max_tokens": 300})
            done = asyncio.Event()
            pressed = []

            def on_token(_token: int) -> None:
                users = [m for m in app.conv.messages if m["role"] == "user"]
                if len(users) == 3 and not pressed:  # the third reply is streaming: Ctrl-C
                    pressed.append([m["content"] for m in users])
                    os.kill(os.getpid(), signal.SIGINT)

            app.on_token = on_token
            task = asyncio.get_running_loop().create_task(app.run())
            task.add_done_callback(lambda _: done.set())
            pipe.send_text("first question\r")
            pipe.send_text("second\x1b\rline two\r")  # Alt-Enter makes a 2-line message
            pipe.send_text("third, to be cancelled\r")
            pipe.send_text("/stats\r/reset\r/nonsense\r")
            pipe.send_text("\x04")  # Ctrl-D
            await asyncio.wait_for(done.wait(), timeout=120)
            await task
    text = out.getvalue()
    assert "[reply cancelled]" in text
    assert "[conversation reset]" in text
    assert "unknown command /nonsense" in text
    assert "prefilled" in text  # /stats
    assert pressed[0] == ["first question", "second\nline two", "third, to be cancelled"]
    assert app.conv.messages == []  # /reset emptied the history


async def test_a_follow_up_continues_from_the_generated_ids_not_the_reply_text(vault, tmp_path):
    """The follow-up's prompt is the stream (the ids the model generated) and the template's
    text after the reply: the reply is never tokenized again, so a tokenizer that would give
    other ids for its text (here: a template that must not be asked) changes nothing, and
    only the new turn is prefilled."""
    async with Engine.open(vault.path) as engine:
        conv = engine.conversation(system="You are terse.")
        await reply(conv, "Tell me about the sea.", max_tokens=12)
        stream = conv.tokens
        tok = engine.tokenizer
        marked = [*conv.messages[:-1], {"role": "assistant", "content": "\ue000"}]
        marked.append({"role": "user", "content": "More."})
        text = tok.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
        tail = text.split("\ue000")[1]
        if stream[-1] in tok.eos_token_ids:  # the reply's own end of turn is in the stream
            tail = tail.removeprefix(tok.decode([stream[-1]]))
        new_turn = tok.encode(tail, add_special_tokens=False)

        def no_templating(messages):
            raise AssertionError("the follow-up re-tokenized the history")

        twin = await conv.fork()  # the same history, to check the logits on
        conv.template = twin.template = no_templating
        expected = np.asarray(await engine.logits([*stream, *new_turn]))[-1]
        assert np.array_equal(await twin.next_logits("More."), expected)
        _, s2 = await reply(conv, "More.", max_tokens=2)
        # the reply's last id (sampled, never run) and the new turn but its last token
        assert s2.prefilled_tokens == len(new_turn)
        loaded = await engine.load_conversation(await twin.save(tmp_path / "chat"))
        loaded.template = no_templating  # a loaded chat continues from the same ids
        assert np.array_equal(await loaded.next_logits("More."), expected)
        assert conv.tokens[: len(stream) + len(new_turn)] == [*stream, *new_turn]


async def test_a_cancelled_chat_is_not_taken_for_ctrl_c(tmp_path):
    """Ctrl-C stops only the reply (its own cancel scope); cancelling the chat itself
    propagates out of ``reply``, and the SIGINT handler is gone afterwards."""
    from prompt_toolkit.application import create_app_session
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    from smoe.chat.repl import ChatApp

    streaming = asyncio.Event()

    class StallingConversation:
        async def send(self, text, **kw):
            streaming.set()
            await asyncio.Event().wait()  # a reply that never ends
            yield  # pragma: no cover

    out = io.StringIO()
    with create_pipe_input() as pipe, create_app_session(input=pipe, output=DummyOutput()):
        app = ChatApp(None, StallingConversation(), out=out)
        task = asyncio.get_running_loop().create_task(app.reply("hello"))
        await streaming.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert "[reply cancelled]" not in out.getvalue()
    assert not asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)  # none left
