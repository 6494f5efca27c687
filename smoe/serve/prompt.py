"""The way from a request to a prompt in `smoe serve`, bounded in memory and kept off the
event loop: the body read within the request memory (smoe/serve/intake.py), parsed, its
fields checked, the chat template applied and the text tokenized on worker threads, one
request at a time per lane; a text the context cannot hold refused before it is
tokenized (smoe/serve/vocab.py); 429 for a full queue once the body is in, before any work.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web
from jinja2 import TemplateError

from smoe.engine import Engine
from smoe.errors import SmoeError
from smoe.serve.api_error import ApiError
from smoe.serve.body import check_content_type, parse_body
from smoe.serve.intake import RequestMemory, off_loop, read_body
from smoe.serve.prefix import PrefixCache, reply_prompt
from smoe.serve.tools import check_tool_support
from smoe.serve.vocab import text_limit


@dataclass
class Turn:
    """A chat request's messages, and whether its prompt continues a cached reply."""

    messages: list[dict[str, str]]
    continued: bool = False


class Intake:
    """Requests into prompts for one engine (module doc); event loop only, except what it
    runs on worker threads itself."""

    def __init__(
        self,
        engine: Engine,
        cache: PrefixCache,
        *,
        max_queue: int,
        max_body_bytes: int,
        body_timeout_s: float,
        request_memory: int,
    ) -> None:
        self.engine, self.cache = engine, cache
        self.max_queue, self.max_body_bytes, self.body_timeout_s = (
            max_queue,
            max_body_bytes,
            body_timeout_s,
        )
        self.memory = RequestMemory(request_memory)
        self.in_preparation = 0  # requests being prepared (counted against max_queue)
        # The most bytes of text the context may hold in tokens (smoe/serve/vocab.py)
        tok = engine.tokenizer
        self.text_limit = None if tok is None else text_limit(tok, engine.max_context)

    @contextlib.asynccontextmanager
    async def preparing(self, request: web.Request) -> AsyncIterator[dict[str, Any]]:
        """The request's JSON object, for its preparation (fields checked, templated,
        tokenized: each with ``off_loop``) inside this block. The body is read within the
        request memory, then parsed on a worker thread; the block holds one of two lanes
        (small bodies, large ones) so one request at a time per lane is prepared
        (smoe/serve/intake.py), and neither the event loop nor a small request waits on
        a large one. ApiError 429 when ``max_queue`` requests wait for the batch already,
        counting those being prepared (checked once the body is in, before any work on
        it), else each 4xx of the body's media type, size, arrival and syntax.
        Cancellation passes through once a worker thread is done; the body's memory is
        given back."""
        check_content_type(request.headers.get("Content-Type"))
        body = await read_body(request, self.memory, self.max_body_bytes, self.body_timeout_s)
        try:
            # After the body (its memory is bounded; a stalled one must not hold a queue
            # place), before any work on it.
            if self.engine.queued + self.in_preparation >= self.max_queue:
                raise ApiError(
                    429, "too many requests are waiting; retry later", "rate_limit_error"
                )
            self.in_preparation += 1
            try:

                def parse() -> dict[str, Any]:
                    self.memory.check_parse(body.raw)
                    return parse_body(body.raw)

                async with self.memory.small_lane if body.small else self.memory.large_lane:
                    yield await off_loop(parse)
            finally:
                self.in_preparation -= 1
        finally:
            body.release()

    async def read_object(self, request: web.Request) -> dict[str, Any]:
        """The request's JSON object, checked as ``preparing`` checks it, for a request
        that is not templated (its memory is given back at once). ApiError as
        ``preparing``; cancellation passes through."""
        async with self.preparing(request) as body:
            return body

    async def template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], param: str = "tools"
    ) -> tuple[list[int], Turn | None]:
        """The prompt's ids for chat ``messages`` (and ``tools``, OpenAI's form) through
        the model's chat template, and the turn the prefix cache may keep (plain chats
        only); the template and the tokenizer run on a worker thread (inside
        ``preparing``). ApiError 400 when the model has no tokenizer, cannot call tools
        (``param`` names the field), its template refuses the messages, or their text
        cannot fit the context; 413 when tokenizing it would take more than a request's
        memory."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ApiError(400, "this model has no tokenizer; use /v1/completions with ids")
        if tools:
            check_tool_support(tok, param)
        plain = not tools and all(
            m.keys() == {"role", "content"} and isinstance(m["content"], str) for m in messages
        )
        said = cast(list[dict[str, str]], messages)
        repeated = self.cache.repeated_reply(said) if plain else None  # (event loop only)

        def render() -> tuple[list[int], bool]:
            if repeated is not None:  # a reply of ours sent back verbatim: continue its ids
                new = sum(len(m["content"]) for m in said[repeated[1] :])
                self.memory.check_tokenize(4 * new)  # (4: UTF-8 bytes per character at most)
                follow = reply_prompt(tok, said, *repeated)
                if follow is not None:
                    return follow, True
            extra = {"tools": tools} if tools else {}
            text = tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **extra
            )
            self.check_text(text if isinstance(text, str) else "", "messages")
            ids = tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, **extra
            )
            return list(ids["input_ids"] if isinstance(ids, dict) else ids), False

        try:
            ids, continued = await off_loop(render)
        except ApiError:
            raise
        except TemplateError as e:  # the model's template refuses them (e.g. role order)
            raise ApiError(
                400,
                f"Invalid 'messages': the model's chat template refused them: {_line(e)}",
                param="messages",
                code="invalid_value",
            ) from None
        except Exception as e:  # the template is the vault's code: it failed on these
            raise ApiError(
                400,
                f"Invalid 'messages': the model's chat template failed on them "
                f"({type(e).__name__}: {_line(e)})",
                param="messages",
                code="invalid_value",
            ) from None
        return ids, Turn(said, continued=continued) if plain else None

    def check_text(self, text: str, param: str) -> None:
        """400 when ``text`` has more bytes than the context can hold in tokens, 413 when
        tokenizing it would take more than a request's memory (worker thread)."""
        n = len(text.encode("utf-8", "surrogatepass"))
        if self.text_limit is not None and n > self.text_limit:
            raise ApiError(
                400,
                f"the prompt's {n} bytes of text cannot fit the context of "
                f"{self.engine.max_context} tokens; shorten the prompt",
                param=param,
                code="context_length_exceeded",
            )
        self.memory.check_tokenize(n)

    async def encode(self, text: str) -> list[int]:
        """``text``'s ids as the tokenizer gives them, on a worker thread (inside
        ``preparing``); ApiError 400 if there is none or the text cannot fit the context, 413 as
        ``template``."""

        def encode() -> list[int]:
            self.check_text(text, "prompt")
            return self.engine.encode(text)

        try:
            return await off_loop(encode)
        except SmoeError as e:  # no tokenizer: the client must send token ids
            raise ApiError(400, str(e), param="prompt") from None


def _line(e: object) -> str:
    """An exception's message on one line, at most 200 characters."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."
