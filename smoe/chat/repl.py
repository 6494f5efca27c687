"""`smoe chat`: a prompt_toolkit REPL over a Conversation.

Enter sends, Alt-Enter (Esc then Enter) adds a line. Ctrl-C while a reply streams cancels
the reply and the chat goes on; Ctrl-C at the prompt clears the line; Ctrl-D quits. The
prompt runs on the engine's event loop, so reads keep being served while the person types.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import anyio
from prompt_toolkit import PromptSession
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings

from smoe.engine import Engine
from smoe.engine.conversation import Conversation
from smoe.errors import SmoeError
from smoe.util.sizes import format_bytes

HELP = """commands:
  /reset, /clear    forget the conversation (keeps the system prompt)
  /system TEXT      set the system prompt and start over (also /set system TEXT: the
                    turns so far were computed after the old one)
  /stats            details of the last reply and of the expert ring
  /save FILE        save the conversation (history + KV cache)
  /load FILE        load a saved conversation
  /help             this text
  /quit, /bye       leave (or Ctrl-D)
Enter sends; Alt-Enter (Esc, Enter) adds a line; Ctrl-C stops a reply."""


def _bindings() -> KeyBindings:
    kb = KeyBindings()

    @kb.add("enter")
    def _send(event: Any) -> None:
        event.current_buffer.validate_and_handle()

    @kb.add("escape", "enter")
    def _newline(event: Any) -> None:
        event.current_buffer.insert_text("\n")

    return kb


@contextlib.contextmanager
def _no_echo(stream: TextIO) -> Iterator[None]:
    """While a reply streams, the terminal does not echo keys into it: what is typed waits,
    unechoed, for the next prompt (type-ahead). Ctrl-C still signals (only ECHO is off).
    Nothing to do where ``stream`` is not a terminal."""
    try:
        fd = stream.fileno()
        if not os.isatty(fd):
            raise OSError
        import termios

        saved = termios.tcgetattr(fd)
    except (OSError, ValueError, ImportError, AttributeError):
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~termios.ECHO  # lflag
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)


class ChatApp:
    """The REPL's state and commands. ``out`` receives the replies and messages."""

    def __init__(
        self,
        engine: Engine,
        conversation: Conversation,
        *,
        out: TextIO | None = None,
        history: History | None = None,
        session_kwargs: dict[str, Any] | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> None:
        self.engine = engine
        self.conv = conversation
        # sys.stdout as it is now, not as it was at import (a redirect made since counts)
        self.out = out if out is not None else sys.stdout
        self.sampling = sampling or {}
        self._history = history or InMemoryHistory()
        self._session_kwargs = session_kwargs or {}
        self.on_token: Callable[[int], None] | None = None  # tests hook in here
        # The last reply was cancelled: it has no figures, and the conversation's last
        # ones are the reply's before it, not to be shown as this one's.
        self._cancelled = False

    def say(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def status(self) -> str:
        s = self.conv.last_stats
        now = self.engine.stats()
        ring = f"ring {now.ring.filled}/{now.ring.slots}"
        if self._cancelled:
            return f" {ring}  ·  reply cancelled"
        if s is None:
            return f" {ring}  ·  /help for commands"
        return (
            f" first token {s.ttft_s:.2f}s  ·  {s.decode_tok_s:.1f} tok/s  ·  "
            f"hit {100 * s.hit_rate:.0f}%  ·  read {format_bytes(s.bytes_read)}  ·  {ring}"
        )

    def _prompt_session(self) -> PromptSession[str]:
        """The terminal's prompt. Made only by ``run``: prompt_toolkit warns on a standard
        input that is not a terminal, which the plain mode (``run_lines``) reads."""
        return PromptSession(
            history=self._history,
            multiline=True,
            key_bindings=_bindings(),
            bottom_toolbar=self.status,
            prompt_continuation="... ",
            **self._session_kwargs,
        )

    async def run(self) -> None:
        self.say("S-MoE chat. /help for commands, Ctrl-D to quit.")
        session = self._prompt_session()
        while True:
            self.engine.learning.prewarm()  # idle: bring in the hot experts while the person types
            try:
                text = await session.prompt_async("> ")
            except KeyboardInterrupt:
                continue
            except EOFError:
                break
            text = text.strip()
            if not text:
                continue
            if text.startswith("/"):
                if not await self.command(text):
                    break
                continue
            await self.reply(text)

    async def run_lines(self, lines: TextIO) -> None:
        """The plain mode, for standard input that is not a terminal (a pipe, a file):
        each line is a message or a /command, each reply printed as it comes; no prompt,
        no status bar, no terminal codes. Ends at the end of the input or at /quit."""
        import anyio

        while True:
            line = await anyio.to_thread.run_sync(lines.readline)  # blocks: off the loop
            if not line:
                break
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                if not await self.command(text):
                    break
                continue
            try:
                await self._stream(text)
            except SmoeError as e:
                self.say(f"error: {e}")

    async def reply(self, text: str) -> None:
        """Stream a reply; Ctrl-C (SIGINT) cancels it and the chat goes on."""
        loop = asyncio.get_running_loop()
        with anyio.CancelScope() as scope:
            try:
                loop.add_signal_handler(signal.SIGINT, scope.cancel)
                handler = True
            except (NotImplementedError, RuntimeError):  # not the main thread, or Windows
                handler = False
            try:
                with _no_echo(sys.stdin):
                    await self._stream(text)
            except SmoeError as e:
                self.say(f"error: {e}")
            finally:
                if handler:
                    loop.remove_signal_handler(signal.SIGINT)
        if scope.cancelled_caught:
            self._cancelled = True
            self.say("\n[reply cancelled]")

    async def _stream(self, text: str) -> None:
        self._cancelled = False
        async for event in self.conv.send(text, **self.sampling):
            if event.text:
                self.out.write(event.text)
                self.out.flush()
            if event.token is not None and self.on_token is not None:
                self.on_token(event.token)
            if event.finish_reason:
                self.say("")

    async def command(self, line: str) -> bool:
        """Run a /command; False means quit."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        try:
            if name in ("/quit", "/exit", "/bye"):  # /bye: ollama's
                return False
            if name == "/set":  # ollama's `/set system TEXT`; its other settings are not ours
                what, _, arg = arg.partition(" ")
                if what != "system" or not arg.strip():
                    raise SmoeError("usage: /set system TEXT")
                name, arg = "/system", arg.strip()
            if name == "/help":
                self.say(HELP)
            elif name in ("/reset", "/clear"):  # /clear: ollama's
                self.conv.reset()
                self.say("[conversation reset]")
            elif name == "/system":
                self.conv.reset(system=arg)
                self.say("[system prompt set; conversation reset]")
            elif name == "/stats":
                self.say(self.stats_text())
            elif name == "/save":
                if not arg:
                    raise SmoeError("usage: /save FILE")
                path = await self.conv.save(_expand(arg))
                self.say(f"[saved to {path}]")
            elif name == "/load":
                if not arg:
                    raise SmoeError("usage: /load FILE")
                self.conv = await self.engine.load_conversation(_expand(arg))
                self._cancelled = False
                self.say(
                    f"[loaded {len(self.conv.messages)} messages, {len(self.conv.tokens)} tokens]"
                )
            else:
                self.say(f"unknown command {name}; /help lists them")
        except SmoeError as e:
            self.say(f"error: {e}")
        except Exception as e:  # a bug: the chat and its conversation outlive it
            why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            self.say(f"error: {name} failed ({why}; an internal error, please report it)")
        return True

    def stats_text(self) -> str:
        s, now = self.conv.last_stats, self.engine.stats()
        st = now.scheduler
        lines = [
            f"ring: {now.ring.filled}/{now.ring.slots} slots "
            f"of {format_bytes(now.ring.slot_bytes)}; hits {st.hits}, misses {st.misses}, "
            f"read {format_bytes(st.bytes_read())} in total",
            f"compute: {now.compute_dtype_note} by {now.arithmetic}",
        ]
        if self._cancelled:
            lines.append("last reply: cancelled, so no figures; the one before it:")
        if s is not None:
            label = "  " if self._cancelled else "last reply: "
            lines.append(
                f"{label}{s.generated_tokens} tokens; prompt {s.prompt_tokens} tokens, "
                f"{s.prefilled_tokens} prefilled (the rest reused); first token {s.ttft_s:.2f} s; "
                f"decode {s.decode_tok_s:.2f} tok/s; hit rate {100 * s.hit_rate:.0f}%; "
                f"read {format_bytes(s.bytes_read)}; I/O wait {100 * s.decode_io_wait_share:.0f}% "
                "of decode"
            )
        for prio, c in st.by_priority.items():
            if c.reads:
                q, r = c.queue_wait.to_json(), c.read_latency.to_json()
                lines.append(
                    f"{prio.name.lower()} reads: {c.reads}, queue wait p50 {q['p50_ms']:.2f} ms "
                    f"p99 {q['p99_ms']:.2f} ms, read p50 {r['p50_ms']:.2f} ms "
                    f"p99 {r['p99_ms']:.2f} ms"
                )
        lines.append(
            f"conversation: {len(self.conv.messages)} messages, "
            f"{len(self.conv.tokens)} tokens of {self.engine.max_context}"
        )
        return "\n".join(lines)


def _expand(path: str) -> str:
    return os.path.expanduser(path)


def history_file() -> History:
    from smoe.util.cache import cache_dir

    path = cache_dir() / "chat_history"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return FileHistory(str(path))
    except OSError:
        return InMemoryHistory()
