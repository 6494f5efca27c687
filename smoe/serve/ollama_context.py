"""Ollama's ``options.num_ctx`` in `smoe serve`: a request's own context length.

Done as Ollama does it: a ``num_ctx`` beyond the model's context is lowered to it
(Ollama's "requested context size too large for model"); a chat whose prompt does not fit
loses its oldest messages, never a system message, the last message, or a tool result
without the call that asked for it (server/prompt.go ``chatPrompt``); a prompt still too
long keeps its first ``NUM_KEEP`` ids and loses those after them (the runner's
"truncating input prompt"). Ollama then shifts its context to go on generating; this
engine cannot, so the reply ends where the context is full (``done_reason`` "length").
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from smoe.serve.api_error import ApiError

NUM_KEEP = 4  # Ollama's default num_keep: ids kept at the start of a cut prompt

Template = Callable[[list[dict[str, Any]]], Awaitable[tuple[list[int], Any]]]


def request_context(num_ctx: int | None, engine_context: int) -> int | None:
    """The request's context length: ``num_ctx`` at most the engine's (None: not sent)."""
    return None if num_ctx is None else min(num_ctx, engine_context)


def cut(ids: list[int], context: int) -> list[int]:
    """``ids`` within ``context`` less one (room for a reply's first token): the first
    ``NUM_KEEP`` ids, then the latest that fit."""
    limit = context - 1
    if len(ids) <= limit:
        return ids
    keep = min(NUM_KEEP, limit)
    return ids[:keep] + ids[len(ids) - (limit - keep) :]


def _block_start(messages: list[dict[str, Any]], i: int) -> int:
    """Where the message ``i`` must start from: a tool result's run of results goes with
    the assistant's message that called the tools."""
    if i <= 0 or messages[i]["role"] != "tool":
        return i
    start = i
    while start > 0 and messages[start - 1]["role"] == "tool":
        start -= 1
    if (
        start > 0
        and messages[start - 1]["role"] == "assistant"
        and messages[start - 1].get("tool_calls")
    ):
        return start - 1
    return i


async def fit_chat(
    messages: list[dict[str, Any]], template: Template, context: int
) -> tuple[list[int], Any]:
    """The prompt's ids (and turn) for the latest ``messages`` that fit ``context``, as
    Ollama drops a chat's oldest messages; ``cut`` if even the last does not fit."""
    ids: list[int] = []
    turn: Any = None
    for i in range(len(messages)):
        start = _block_start(messages, i)
        system = [m for m in messages[:start] if m["role"] == "system"]
        try:
            ids, turn = await template([*system, *messages[start:]])
        except ApiError as e:  # its text alone cannot fit the engine: fewer messages
            if e.code != "context_length_exceeded" or i == len(messages) - 1:
                raise
            continue
        if len(ids) < context or i == len(messages) - 1:
            break
    if len(ids) >= context:
        return cut(ids, context), None  # no messages' prompt: a reply is not kept
    return ids, turn


def reply_room(
    fields: dict[str, Any], predict: int | None, prompt: int, context: int, default: int
) -> None:
    """Set ``fields``' max_tokens within ``context`` after a ``prompt`` of so many ids:
    ``num_predict`` (-2: fill the context), else the server's ``default``, at most the
    room left."""
    room = context - prompt
    asked = room if predict == -2 else fields["max_tokens"] or default
    fields["max_tokens"] = max(1, min(asked, room))
