"""Anthropic's Messages API in `smoe serve`: POST /v1/messages and /v1/messages/count_tokens.

The request (``system``, ``messages`` of text, tool_use and tool_result blocks,
``max_tokens`` required, ``temperature``, ``top_p``, ``top_k``, ``stop_sequences``,
``tools``, ``tool_choice``, ``stream``) is checked, turned into chat-template messages
(a tool_use block becomes an assistant's ``tool_calls``, a tool_result a ``tool``
message) and answered through the server's one pipeline. ``AnthropicFormat`` writes the
``message`` body or its event stream (message_start, content_block_start, ping,
content_block_delta with text_delta / input_json_delta, content_block_stop,
message_delta, message_stop); errors are ``{"type": "error", "error": {type, message}}``.
"""

from __future__ import annotations

import uuid
from typing import Any

from aiohttp import web

from smoe.serve.api_error import ApiError
from smoe.serve.completion import Completion, Format, Usage, sse
from smoe.serve.context import ServeContext
from smoe.serve.describe import show
from smoe.serve.intake import off_loop
from smoe.serve.spec import (
    Limits,
    Spec,
    check_stop,
    check_text,
    required,
    validate_fields,
    wrong_type,
)
from smoe.serve.tools import ToolCall
from smoe.serve.validate import engine_fields

__all__ = ["PATH_PREFIX", "AnthropicFormat", "error_json", "routes"]

PATH_PREFIX = "/v1/messages"  # the paths whose errors take Anthropic's shape

# Anthropic's error type for each status (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def error_json(e: ApiError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def _check_messages(name: str, value: Any, limits: Limits) -> list[dict[str, Any]]:
    """Anthropic's turns as chat-template messages (see the module doc)."""
    if not value:
        raise ApiError(400, f"Invalid '{name}': at least one message is required.", param=name)
    out: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(message, dict):
            raise wrong_type(where, ("object",), message)
        role = required(message, where, "role", ("string",))
        if role not in ("user", "assistant"):
            raise ApiError(
                400,
                f"Invalid '{where}.role': expected user or assistant, but got {show(role)}.",
                param=f"{where}.role",
            )
        content = required(message, where, "content", ("string", "array"))
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        else:
            out += _blocks(f"{where}.content", role, content, limits)
    return out


def _blocks(where: str, role: str, blocks: list[Any], limits: Limits) -> list[dict[str, Any]]:
    """One message's content blocks as template messages: each tool result a ``tool``
    message, then the text and (an assistant's) ``tool_calls`` as one turn."""
    out: list[dict[str, Any]] = []
    texts, calls = [], []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        if not isinstance(block, dict):
            raise wrong_type(at, ("object",), block)
        kind = block.get("type")
        if kind == "text":
            texts.append(required(block, at, "text", ("string",)))
        elif kind == "tool_use" and role == "assistant":
            function = {
                "name": required(block, at, "name", ("string",)),
                "arguments": required(block, at, "input", ("object",)),
            }
            calls.append(
                {
                    "id": required(block, at, "id", ("string",)),
                    "type": "function",
                    "function": function,
                }
            )
        elif kind == "tool_result" and role == "user":
            result = block.get("content", "")
            if not isinstance(result, (str, list)):
                raise wrong_type(f"{at}.content", ("string", "array"), result)
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": required(block, at, "tool_use_id", ("string",)),
                    "content": check_text(f"{at}.content", result, limits),
                }
            )
        else:
            raise ApiError(
                400,
                f"Invalid '{at}.type': this server takes text, tool_use (assistant) and "
                f"tool_result (user) blocks, but got {show(kind)} in a {role} message.",
                param=f"{at}.type",
            )
    if texts or calls or role == "assistant":
        turn: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def _check_tools(name: str, value: Any, limits: Limits) -> list[dict[str, Any]]:
    """Anthropic's client tools (name, description, input_schema) in OpenAI's form, which
    chat templates take."""
    out = []
    for i, tool in enumerate(value):
        at = f"{name}[{i}]"
        if not isinstance(tool, dict):
            raise wrong_type(at, ("object",), tool)
        if tool.get("type") not in (None, "custom"):
            raise ApiError(
                400,
                f"Unsupported value: '{at}.type': this server runs no server tools; "
                f"got {show(tool['type'])}.",
                param=f"{at}.type",
                code="unsupported_value",
            )
        function = {
            "name": required(tool, at, "name", ("string",)),
            "parameters": required(tool, at, "input_schema", ("object",)),
        }
        if tool.get("description") is not None:
            function["description"] = required(tool, at, "description", ("string",))
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(value: Any) -> bool:
    return isinstance(value, dict) and value.get("type") in ("auto", "none")


def _thinking_off(value: Any) -> bool:
    return isinstance(value, dict) and value.get("type") == "disabled"


# fmt: off
FIELDS: dict[str, Spec] = {
    "model": Spec(("string",)),
    "system": Spec(("string", "array"), default="", check=check_text),
    "messages": Spec(("array",), required=True, check=_check_messages),
    "max_tokens": Spec(("integer",), required=True, lo=1, hi="max_tokens"),
    "stop_sequences": Spec(("array",), default=[],
                           check=lambda n, v, lim: check_stop(n, v, lim, most=16)),
    "temperature": Spec(("number",), lo=0, hi=1),  # not sent: the server's default
    "top_p": Spec(("number",), lo=0, hi=1),
    "top_k": Spec(("integer",), default=0, lo=0),
    "stream": Spec(("boolean",), default=False),
    "metadata": Spec(("object",)),
    "tools": Spec(("array",), default=[], check=_check_tools),
    "tool_choice": Spec(("object",), default={"type": "auto"}, supported=_tool_choice,
                        unsupported="is not supported by this server beyond {\"type\": "
                                    "\"auto\"} and {\"type\": \"none\"}"),
    "thinking": Spec(("object",), supported=_thinking_off,
                     unsupported="is not supported by this server"),
}
# fmt: on
COUNT_FIELDS = {k: v for k, v in FIELDS.items() if k in ("model", "system", "messages", "tools")}


def routes(ctx: ServeContext) -> list[web.RouteDef]:
    """The Messages API's routes on ``ctx``."""
    pipeline, intake = ctx.pipeline, ctx.intake

    async def prompt(request: web.Request, table: dict[str, Spec]) -> tuple[Any, ...]:
        async with intake.preparing(request) as body:
            f = await off_loop(validate_fields, body, table, pipeline.limits)
            messages = f["messages"]
            if f["system"]:
                messages = [{"role": "system", "content": f["system"]}, *messages]
            tools = f["tools"] if f.get("tool_choice", {}).get("type") != "none" else []
            ids, turn = await intake.template(messages, tools)
        return f, ids, turn, tools

    async def messages(request: web.Request) -> web.StreamResponse:
        f, ids, turn, tools = await prompt(request, FIELDS)
        fields = engine_fields(
            max_tokens=f["max_tokens"],
            stop=f["stop_sequences"],
            temperature=f["temperature"],
            top_p=f["top_p"],
            top_k=f["top_k"],
            stream=f["stream"],
        )
        return await pipeline.answer(
            request, fields, ids, AnthropicFormat, chat=True, turn=turn, tools=tools
        )

    async def count_tokens(request: web.Request) -> web.Response:
        _, ids, _, _ = await prompt(request, COUNT_FIELDS)
        return web.json_response({"input_tokens": len(ids)})

    return [
        web.post("/v1/messages", messages),
        web.post("/v1/messages/count_tokens", count_tokens),
    ]


class AnthropicFormat(Format):
    """One ``message``: its id and, when streaming, the content block open."""

    def __init__(self, out: Completion) -> None:
        super().__init__(out)
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.blocks = 0  # content blocks started
        self.open_text = False  # a text block is open

    @property
    def stop_reason(self) -> str:
        out = self.out
        if out.calls and out.finish == "stop":
            return "tool_use"
        if out.stops.stopped:
            return "stop_sequence"
        return "end_turn" if out.finish == "stop" else "max_tokens"

    def _usage(self, usage: Usage) -> dict[str, Any]:
        return {
            "input_tokens": usage.prompt,
            "output_tokens": usage.completion,
            "cache_read_input_tokens": usage.reused,
        }

    def body(self, usage: Usage) -> dict[str, Any]:
        out = self.out
        content: list[dict[str, Any]] = []
        if out.reply or not out.calls:
            content.append({"type": "text", "text": out.reply})
        content += [_tool_use(c) for c in out.calls]
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": out.model,
            "content": content,
            "stop_reason": self.stop_reason,
            "stop_sequence": out.stops.matched,
            "usage": self._usage(usage),
        }

    def _event(self, data: dict[str, Any]) -> bytes:
        return sse(data, data["type"])

    def opening(self, prompt: int, reused: int) -> list[bytes]:
        message: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.out.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt, "output_tokens": 0},
        }
        return [self._event({"type": "message_start", "message": message})]

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        events = self._stop_text()
        events.append(
            self._event(
                {"type": "content_block_start", "index": self.blocks, "content_block": block}
            )
        )
        if not self.blocks:
            events.append(self._event({"type": "ping"}))
        self.blocks += 1
        return events

    def _stop_text(self) -> list[bytes]:
        if not self.open_text:
            return []
        self.open_text = False
        return [self._event({"type": "content_block_stop", "index": self.blocks - 1})]

    def text(self, piece: str) -> list[bytes]:
        events = []
        if not self.open_text:
            events = self._start({"type": "text", "text": ""})
            self.open_text = True
        delta = {"type": "text_delta", "text": piece}
        events.append(
            self._event({"type": "content_block_delta", "index": self.blocks - 1, "delta": delta})
        )
        return events

    def calls(self, calls: list[ToolCall]) -> list[bytes]:
        events = []
        for call in calls:
            events += self._start({**_tool_use(call), "input": {}})
            index = self.blocks - 1
            delta = {"type": "input_json_delta", "partial_json": call.arguments_json}
            events.append(
                self._event({"type": "content_block_delta", "index": index, "delta": delta})
            )
            events.append(self._event({"type": "content_block_stop", "index": index}))
        return events

    def closing(self, usage: Usage) -> list[bytes]:
        events = self._stop_text()
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.out.stops.matched}
        events.append(
            self._event({"type": "message_delta", "delta": delta, "usage": self._usage(usage)})
        )
        events.append(self._event({"type": "message_stop"}))
        return events

    def failure(self, error: ApiError) -> list[bytes]:
        return [sse(error_json(error), "error")]


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}
