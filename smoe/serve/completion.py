"""One request's answer in `smoe serve`, built as the engine generates it.

``Completion`` follows the engine's events (stop strings cut the text) and makes OpenAI's
JSON body or its server-sent-event chunks; ``usage`` is OpenAI's usage block; the
functions below open such an event stream, write to it and end it, with an error event
when the failure comes after the status (200) has been sent.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from smoe.serve.api_error import failure
from smoe.serve.stops import StopMatcher


def usage(prompt: int, completion: int, reused: int) -> dict[str, Any]:
    """OpenAI's usage block; ``cached_tokens`` is its name for the prompt tokens reused."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": reused},
    }


@dataclass
class Completion:
    """One request's answer as it is generated: the text after stop strings, the ids
    shown, how it finished, and its OpenAI identity (id, object kind, creation time)."""

    chat: bool
    stops: StopMatcher
    model: str  # the name the answer gives (the server has one model)
    id: str = ""
    kind: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)  # the ids shown (not an end of turn)
    completion: int = 0
    finish: str = "length"
    ended: bool = False  # the model ended its turn (its end-of-turn id is in the stream)

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.kind = "chat.completion" if self.chat else "text_completion"

    def feed(self, event: Any) -> str:
        """Take one engine event; return the text it adds for the client ('' for none)."""
        if event.token is not None:
            self.completion += 1
            self.generated.append(event.token)
        if event.finish_reason:
            self.finish = event.finish_reason
            self.ended = self.finish == "stop"
        piece = self.stops.feed(event.text) if event.text else ""
        if self.stops.stopped:
            self.finish = "stop"
        elif event.finish_reason:
            piece += self.stops.flush()
        if piece:
            self.text.append(piece)
        return piece

    @property
    def reply(self) -> str:
        return "".join(self.text)

    def body(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The non-streaming JSON answer."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": self.reply}
        else:
            choice["text"] = self.reply
        return {
            "id": self.id,
            "object": self.kind,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        }

    def chunk(
        self, text: str, finish: str | None, usage: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """One server-sent event of the streamed answer: ``text`` added, ``finish`` (the
        last chunk's reason, else None) and ``usage`` (the last chunk's)."""
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": text} if text else {},
                "finish_reason": finish,
            }
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish}
            obj = self.kind
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if usage is not None:
            chunk["usage"] = usage
        return chunk


async def open_stream(request: web.Request, request_id: str) -> web.StreamResponse:
    """A server-sent-events answer, its status (200) and headers sent."""
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Request-Id": request_id,
        }
    )
    await response.prepare(request)
    return response


async def send_event(response: web.StreamResponse, data: dict[str, Any]) -> None:
    """One server-sent event carrying ``data`` as JSON; ConnectionError if the client
    has gone."""
    await response.write(f"data: {json.dumps(data)}\n\n".encode())


async def end_stream(response: web.StreamResponse, out: Completion, usage: dict[str, Any]) -> None:
    """The last chunk (how ``out`` finished, and its ``usage``), then ``[DONE]``."""
    await send_event(response, out.chunk("", out.finish, usage))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()


async def stream_failure(response: web.StreamResponse, e: Exception, rid: str) -> None:
    """The stream has begun (status 200 sent): the error goes as an event."""
    error = json.dumps(failure(e, rid).to_json())
    with contextlib.suppress(ConnectionError):  # the client may be gone too
        await response.write(f"data: {error}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
