"""Tool calls in `smoe serve`: the model's calls found in its text and parsed, with mlx-lm.

mlx-lm's tokenizer wrapper knows each model family's tool-call format (``has_tool_calling``,
``tool_call_start``/``tool_call_end`` markers, ``tool_parser``: one of mlx_lm/tool_parsers,
picked from the chat template). ``ToolCallSplitter`` cuts the reply's text at those markers
with mlx-lm's own ``TextStateMachine`` (the one its server uses) and parses each call with
the model's parser, as mlx_lm/server.py does. Every dialect then formats the same
``ToolCall`` objects (OpenAI ``tool_calls``, Anthropic ``tool_use``, Ollama ``tool_calls``).
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, cast

from smoe.serve.api_error import ApiError

log = logging.getLogger("smoe.serve")


@dataclass
class ToolCall:
    """One call the model made: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def check_tool_support(tok: Any, param: str = "tools") -> None:
    """ApiError 400 unless the model's tokenizer has a tool-call format mlx-lm parses."""
    if tok is None or not getattr(tok, "has_tool_calling", False):
        raise ApiError(
            400,
            f"Unsupported value: '{param}': this model cannot call tools (its chat template "
            "has no tool-call format that mlx-lm can parse); send the request without tools.",
            param=param,
            code="unsupported_value",
        )
    formats = getattr(tok, "response_transitions", None) or {}
    if any(dst == "tool" for edges in formats.values() for _, dst in edges):
        raise ApiError(  # mlx-lm's response formats (muse_spark): calls found by channel
            400,
            f"Unsupported value: '{param}': this model marks its tool calls with a response "
            "format (mlx-lm's chat_templates) that this server does not split yet; send "
            "the request without tools.",
            param=param,
            code="unsupported_value",
        )


class ToolCallSplitter:
    """The reply's text split into plain text and tool calls as it streams. Text that may
    begin a call marker is held back until the next piece decides (mlx-lm's
    TextStateMachine). A call whose text the model's parser refuses (e.g. cut short by
    max_tokens) is given back as plain text, markers included, rather than dropped."""

    def __init__(self, tok: Any, tools: list[dict[str, Any]]) -> None:
        from mlx_lm.generate import TextStateMachine  # the MLX side: imported on use

        self._start, self._end = tok.tool_call_start, tok.tool_call_end
        transitions = {
            "normal": [(self._start, "tool")],
            "tool": [(self._end, "normal")] if self._end else [],
        }
        self._machine: Any = cast(Any, TextStateMachine)  # untyped; its state: a tuple
        self._state: Any = self._machine(transitions).make_state("normal")
        self._parser = tok.tool_parser
        self._tools = tools
        self._call_text = ""
        self._in_call = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Take a piece of the reply; return the plain text it releases and the calls it
        completes."""
        self._state, segments = self._machine.split(self._state, text)
        return self._segments(segments)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The reply has ended: release what is held back; a call left open is parsed."""
        self._state, rest, state = self._machine.flush(self._state)
        plain, calls = self._segments([(state, rest)])
        if self._in_call:  # no end marker (a format without one, or cut short)
            more, call = self._close(closed=False)
            plain += more
            calls += call
        return plain, calls

    def _segments(self, segments: list[tuple[str | None, str]]) -> tuple[str, list[ToolCall]]:
        plain, calls = "", []
        for state, text in segments:
            if state == "tool":
                self._in_call = True
                self._call_text += text
                continue
            if self._in_call:  # the call's end marker was passed
                more, call = self._close(closed=True)
                plain += more
                calls += call
            plain += text
        return plain, calls

    def _close(self, closed: bool) -> tuple[str, list[ToolCall]]:
        """The call's text parsed; ``closed``: its end marker was seen (and stripped)."""
        text, self._call_text, self._in_call = self._call_text, "", False
        try:
            parsed = self._parser(text, self._tools)
            calls = [_tool_call(p) for p in (parsed if isinstance(parsed, list) else [parsed])]
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            log.warning("a tool call the model's parser refused is sent as text: %s", e)
            return f"{self._start}{text}{self._end if closed else ''}", []
        return "", calls


def _tool_call(parsed: Any) -> ToolCall:
    """mlx-lm's parsed call ({name, arguments}) checked: a name and a JSON object."""
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        raise ValueError(f"not a call with a name: {str(parsed)[:80]}")
    arguments = parsed.get("arguments", {})
    if isinstance(arguments, str):
        arguments = json.loads(arguments or "{}")
    if not isinstance(arguments, dict):
        raise ValueError("the call's arguments are not a JSON object")
    return ToolCall(parsed["name"], arguments)
