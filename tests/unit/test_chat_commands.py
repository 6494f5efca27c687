"""The chat REPL's commands that users of ollama bring (issue 51): /bye, /clear and
/set system TEXT; and the status bar after Ctrl-C shows no figures of an earlier reply."""

from __future__ import annotations

import io
import os
import signal

import pytest

from smoe.chat.repl import ChatApp
from smoe.engine import Engine
from tests.conftest import tiny_vault

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    return tiny_vault(tmp_path_factory.mktemp("chat-commands"), seed=51)


async def test_bye_clear_and_set_system(vault):
    out = io.StringIO()
    async with Engine.open(vault.path) as engine:
        app = ChatApp(engine, engine.conversation(), out=out, sampling={"max_tokens": 3})
        lines = "hello\n/set system Be brief.\n/set temperature 1\nagain\n/clear\n/bye\nnever\n"
        await app.run_lines(io.StringIO(lines))
        conv = app.conv
        assert conv.system == "Be brief."  # kept through /clear, as /reset keeps it
        # /bye left before "never": no turn after /clear
        assert conv.messages == [{"role": "system", "content": "Be brief."}]
    text = out.getvalue()
    assert "[system prompt set; conversation reset]" in text
    assert "error: usage: /set system TEXT" in text  # ollama's other /set settings
    assert "[conversation reset]" in text


async def test_a_cancelled_reply_leaves_no_figures_in_the_status_bar(vault):
    async with Engine.open(vault.path) as engine:
        app = ChatApp(engine, engine.conversation(), out=io.StringIO())
        app.sampling = {"max_tokens": 4}
        await app.reply("first")
        assert "tok/s" in app.status() and "last reply: " in app.stats_text()

        def interrupt(_token: int) -> None:  # Ctrl-C once the second reply streams
            app.on_token = None
            os.kill(os.getpid(), signal.SIGINT)

        app.on_token = interrupt
        app.sampling = {"max_tokens": 200}
        await app.reply("second")
        assert "[reply cancelled]" in app.out.getvalue()
        status = app.status()
        assert "tok/s" not in status and "reply cancelled" in status, status
        details = app.stats_text()  # the figures there are labelled as the reply's before
        assert "last reply: cancelled, so no figures; the one before it:" in details


async def test_the_chat_writes_to_the_stdout_of_when_it_is_made(monkeypatch):
    """The default output is sys.stdout when the chat is made, not when its module was
    imported: a redirect made in between (a test's capture, a caller's) gets the replies."""
    import io

    from smoe.chat.repl import ChatApp

    later = io.StringIO()
    monkeypatch.setattr("sys.stdout", later)
    app = ChatApp.__new__(ChatApp)
    ChatApp.__init__(app, engine=None, conversation=None)  # type: ignore[arg-type]
    app.say("hello")
    assert later.getvalue() == "hello\n"
