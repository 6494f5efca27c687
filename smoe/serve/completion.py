"""One request's answer in `smoe serve`, built as the engine generates it, whatever the API.

``Completion`` follows the engine's events: tool calls are split out of the text (when the
request has tools), stop strings cut the rest, and it records how the reply finished.
``Usage`` is what every API's usage block is made of. The functions below open an event
stream, write a dialect's events to it and end it; each API's formatting lives in its
dialect module (openai_api.py, anthropic_api.py, ollama_api.py).
"""

from __future__ import annotations

import contextlib
import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from smoe.serve.api_error import ApiError
from smoe.serve.stops import StopMatcher
from smoe.serve.tools import ToolCall, ToolCallSplitter


def usage(prompt: int, completion: int, reused: int) -> dict[str, Any]:
    """OpenAI's usage block; ``cached_tokens`` is its name for the prompt tokens reused."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": reused},
    }


@dataclass
class Usage:
    """A request's counts and times: tokens in the prompt, generated and reused; seconds
    from its arrival to the first token and to the end (Ollama reports durations)."""

    prompt: int
    completion: int
    reused: int
    first_token_s: float = 0.0
    total_s: float = 0.0

    def openai(self) -> dict[str, Any]:
        return usage(self.prompt, self.completion, self.reused)


@dataclass
class Completion:
    """One request's answer as it is generated: the text after stop strings, the tool
    calls found, the ids shown and how it finished ("stop": the model ended its turn or a
    stop string matched, "length": max_tokens)."""

    chat: bool
    stops: StopMatcher
    model: str  # the name the answer gives (the server has one model)
    tools: ToolCallSplitter | None = None  # splits out tool calls when the request has tools
    started: float = field(default_factory=time.perf_counter)
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    new_calls: list[ToolCall] = field(default_factory=list)  # found since the last take
    generated: list[int] = field(default_factory=list)  # the ids shown (not an end of turn)
    completion: int = 0
    finish: str = "length"
    ended: bool = False  # the model ended its turn (its end-of-turn id is in the stream)
    first_token_s: float = 0.0
    index: int = 0  # the choice's place in the answer (n > 1, several prompts)
    # Where the request asked: the numbers (a smoe.serve.logprobs.LogprobLog), and the
    # prompt (``prompt_ids``) with its text, given before the reply (completions' echo).
    logprobs: Any = None
    echo: str | None = None
    prompt_ids: list[int] = field(default_factory=list)

    def feed(self, event: Any) -> str:
        """Take one engine event; return the text it adds for the client ('' for none).
        Tool calls it completes go to ``calls`` and ``new_calls``."""
        head = self.echoed()
        if event.prompt_logprobs is not None and self.logprobs is not None:
            self.logprobs.prompt(self.prompt_ids, event.prompt_logprobs)
        if event.token is not None:
            if not self.completion:
                self.first_token_s = time.perf_counter() - self.started
            self.completion += 1
            self.generated.append(event.token)
            if self.logprobs is not None and event.logprob is not None:
                self.logprobs.token(event.token, event.logprob, event.top_logprobs or ())
        elif event.end_token is not None and self.logprobs is not None and not self.chat:
            # completions list the EOS id that ended them too (as vLLM; lm-eval's scoring
            # drops the last generated entry); chat's content has only the reply's tokens
            self.logprobs.token(event.end_token, event.logprob, event.top_logprobs or ())
        if event.finish_reason:
            self.finish = event.finish_reason
            self.ended = self.finish == "stop"
        text = event.text
        if self.tools is not None:
            text, calls = self.tools.feed(text) if text else ("", [])
            if event.finish_reason:
                rest, more = self.tools.finish()
                text, calls = text + rest, calls + more
            self.calls += calls
            self.new_calls += calls
        piece = self.stops.feed(text) if text else ""
        if self.stops.stopped:
            self.finish = "stop"
        elif event.finish_reason:
            piece += self.stops.flush()
        if piece:
            self.text.append(piece)
        return head + piece

    def echoed(self) -> str:
        """The prompt's text the first time (echo), else ''; it is not matched for stops."""
        head, self.echo = self.echo or "", None
        if head:
            self.text.append(head)
        return head

    def take_calls(self) -> list[ToolCall]:
        """The tool calls found since the last take."""
        calls, self.new_calls = self.new_calls, []
        return calls

    @property
    def reply(self) -> str:
        return "".join(self.text)

    def usage(self, prompt: int, reused: int) -> Usage:
        return Usage(
            prompt,
            self.completion,
            reused,
            self.first_token_s,
            time.perf_counter() - self.started,
        )


class Format(ABC):
    """How one API writes one request's answer (made per request: it may number its
    events): the JSON body, or the stream's events, already framed as bytes."""

    stream_type = "text/event-stream"

    def __init__(self, out: Completion) -> None:
        self.out = out

    @abstractmethod
    def body(self, usage: Usage) -> dict[str, Any]:
        """The non-streaming answer."""

    def opening(self, prompt: int, reused: int) -> list[bytes]:
        """The stream's first events, before any token."""
        return []

    @abstractmethod
    def text(self, piece: str) -> list[bytes]:
        """Events for a piece of the reply's text."""

    @abstractmethod
    def calls(self, calls: list[ToolCall]) -> list[bytes]:
        """Events for tool calls the model completed."""

    @abstractmethod
    def closing(self, usage: Usage) -> list[bytes]:
        """The stream's last events: how it finished, the usage."""

    @abstractmethod
    def failure(self, error: ApiError) -> list[bytes]:
        """The stream's last events when it fails after its status (200) was sent."""


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event carrying ``data`` as JSON (named ``event`` if given)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


async def open_stream(
    request: web.Request, request_id: str, content_type: str = "text/event-stream"
) -> web.StreamResponse:
    """A streamed answer (server-sent events, or NDJSON for Ollama), its status (200) and
    headers sent."""
    response = web.StreamResponse(
        headers={
            "Content-Type": content_type,
            "Cache-Control": "no-cache",
            "X-Request-Id": request_id,
        }
    )
    await response.prepare(request)
    return response


async def send(response: web.StreamResponse, events: list[bytes]) -> None:
    """Write ``events`` (already framed by the dialect); ConnectionError if the client
    has gone."""
    for event in events:
        await response.write(event)


async def end_stream(response: web.StreamResponse, events: list[bytes]) -> None:
    """The stream's last ``events``, then its end."""
    await send(response, events)
    await response.write_eof()


async def stream_failure(response: web.StreamResponse, events: list[bytes]) -> None:
    """The stream has begun (status 200 sent): the error goes as the dialect's events."""
    with contextlib.suppress(ConnectionError):  # the client may be gone too
        await end_stream(response, events)
