"""OpenAI's answers in `smoe serve`: the /v1/chat/completions and /v1/completions bodies
and streams, one ``OpenAIFormat`` per choice.

The body (``chat.completion`` / ``text_completion``), the streamed chunks (server-sent
events ending with ``data: [DONE]``), tool calls as ``tool_calls`` (``finish_reason``
"tool_calls"), and a stream's error as ``{"error": {message, type, param, code}}``
(``ApiError.to_json``). The routes are smoe/serve/openai_api.py's. A choice's ``logprobs``
are smoe/serve/logprobs.py's; answers of several choices (``n``, a list of prompts) are
put together by smoe/serve/choices.py from one format per choice.
"""

from __future__ import annotations

import uuid
from typing import Any

from smoe.serve.api_error import ApiError
from smoe.serve.completion import Completion, Format, Usage, sse
from smoe.serve.tools import ToolCall

DONE = b"data: [DONE]\n\n"


class OpenAIFormat(Format):
    """One OpenAI answer: its id, object kind and creation time, and its chunks."""

    def __init__(self, out: Completion) -> None:
        super().__init__(out)
        self.id = ("chatcmpl-" if out.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.kind = "chat.completion" if out.chat else "text_completion"
        self.sent_calls = 0  # a streamed call's index
        self.sent_role = False  # OpenAI's first chunk of a chat stream names the role

    @property
    def finish(self) -> str:
        return "tool_calls" if self.out.calls and self.out.finish == "stop" else self.out.finish

    def body(self, usage: Usage) -> dict[str, Any]:
        return self.envelope([self.choice()], usage.openai())

    def choice(self) -> dict[str, Any]:
        """The non-streaming answer's choice (``choices[i]``)."""
        out = self.out
        numbers = out.logprobs.all() if out.logprobs is not None else None
        choice: dict[str, Any] = {
            "index": out.index,
            "finish_reason": self.finish,
            "logprobs": numbers,
        }
        if out.chat:
            message: dict[str, Any] = {"role": "assistant", "content": out.reply}
            if out.calls:
                message["content"] = out.reply or None
                message["tool_calls"] = [_call(c) for c in out.calls]
            choice["message"] = message
        else:
            choice["text"] = out.reply
        return choice

    def envelope(self, choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        """The non-streaming answer around ``choices``."""
        return {
            "id": self.id,
            "object": self.kind,
            "created": self.out.created,
            "model": self.out.model,
            "choices": choices,
            "usage": usage,
        }

    def chunk(
        self,
        text: str,
        finish: str | None,
        usage: dict[str, Any] | None = None,
        calls: list[ToolCall] | None = None,
    ) -> dict[str, Any]:
        """One chunk of the streamed answer: ``text`` (or ``calls``) added, ``finish``
        (the last chunk's reason, else None) and ``usage`` (the last chunk's); the numbers
        of the tokens since the last chunk where the request asked for them."""
        out = self.out
        if out.chat:
            delta: dict[str, Any] = {"content": text} if text else {}
            if not self.sent_role:
                delta = {"role": "assistant", **delta}
                self.sent_role = True
            if calls:
                delta["tool_calls"] = [
                    {"index": self.sent_calls + i, **_call(c)} for i, c in enumerate(calls)
                ]
                self.sent_calls += len(calls)
            choice: dict[str, Any] = {"index": out.index, "delta": delta, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": out.index, "text": text, "finish_reason": finish}
            obj = self.kind
        if out.logprobs is not None:
            choice["logprobs"] = out.logprobs.take()
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": out.created,
            "model": out.model,
            "choices": [choice],
        }
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    def text(self, piece: str) -> list[bytes]:
        return [sse(self.chunk(piece, None))]

    def calls(self, calls: list[ToolCall]) -> list[bytes]:
        return [sse(self.chunk("", None, calls=calls))]

    def closing(self, usage: Usage) -> list[bytes]:
        return [sse(self.chunk("", self.finish, usage.openai())), DONE]

    def ending(self) -> list[bytes]:
        """One choice's last chunk among several (its finish; no usage, no [DONE])."""
        return [sse(self.chunk("", self.finish))]

    def usage_chunk(self, usage: dict[str, Any]) -> list[bytes]:
        """The last chunk of an answer of several choices: the usage, then [DONE]."""
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.out.chat else self.kind,
            "created": self.out.created,
            "model": self.out.model,
            "choices": [],
            "usage": usage,
        }
        return [sse(chunk), DONE]

    def failure(self, error: ApiError) -> list[bytes]:
        return [sse(error.to_json()), DONE]


def _call(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments_json},
    }
