"""The one pipeline every API of `smoe serve` answers through: a request's checked fields
and its prompt's ids in, the engine's events into a ``Completion``, out in the API's
``Format`` (its JSON body, or its stream of events as the tokens come).

Each request takes the cached sequence sharing the longest prefix with its prompt (from
memory, or from the disk store), generates on it in the engine's batcher, and gives it
back to the prefix cache whatever happens, with the chat reply it made where that reply
can be continued (smoe/serve/prefix.py). Answers of several choices are
smoe/serve/choices.py's, built on ``Pipeline.generate``.

Event loop only. The engine tells a request which sequence its prompt was pointed at, and
how much of the prompt is left to prefill, from its compute thread (``Engine.stream``'s
``on_prepared``); ``on_loop`` hands that over to the event loop, where the counting runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from smoe.engine import Engine
from smoe.engine.handles import SequenceHandle
from smoe.engine.prefix_store import PrefixStore
from smoe.errors import SmoeError
from smoe.serve.api_error import ApiError
from smoe.serve.completion import (
    Completion,
    Format,
    end_stream,
    open_stream,
    send,
    stream_failure,
)
from smoe.serve.counters import ServerCounts
from smoe.serve.health import Health
from smoe.serve.logprobs import LogprobLog, TokenText, asked
from smoe.serve.options import ServerOptions
from smoe.serve.prefix import ChatReply, PrefixCache, kept_reply
from smoe.serve.prompt import Turn
from smoe.serve.request_options import RequestOptions, request_options
from smoe.serve.request_scope import DROPPED, REQUEST_ID, count_generated
from smoe.serve.spec import Limits
from smoe.serve.stops import StopMatcher
from smoe.serve.tools import ToolCallSplitter

__all__ = ["MAX_TOKENS_LIMIT", "Pipeline", "on_loop"]

MAX_TOKENS_LIMIT = 32768
log = logging.getLogger("smoe.serve")

Prepared = Callable[[SequenceHandle, int], None]  # (the sequence, prompt tokens to prefill)


def on_loop(then: Prepared) -> Prepared:
    """``Engine.stream``'s ``on_prepared`` hook for ``then``: the engine calls the hook on
    its compute thread, which only hands the sequence and the count to this event loop,
    where ``then`` runs. It runs before the request's first event (the loop runs what was
    handed to it in order, and the batcher hears that the prompt is ready after it)."""
    loop = asyncio.get_running_loop()

    def hand_over(sequence: SequenceHandle, run: int) -> None:  # compute thread
        loop.call_soon_threadsafe(then, sequence, run)

    return hand_over


def dress(
    out: Completion, fields: dict[str, Any], ids: list[int], echo: str | None, text: TokenText
) -> None:
    """Give ``out`` what the request asks beyond text: its numbers (``logprobs``) and the
    prompt's text before the reply (``echo``: the prompt as sent, or its ids decoded)."""
    if asked(fields, out.chat)[0] is not None:
        out.logprobs = LogprobLog(out.chat, text)
    out.echo, out.prompt_ids = echo, ids


class Pipeline:
    """Requests' generations on one engine, with the prefix cache and its counts."""

    def __init__(
        self, engine: Engine, options: ServerOptions, counts: ServerCounts, health: Health
    ) -> None:
        self.engine, self.options, self.counts, self.health = engine, options, counts, health
        self.cache = PrefixCache(options.cached_sequences, options.cached_bytes)
        self.store = (
            None
            if options.prefix_dir is None
            else PrefixStore(
                engine, options.prefix_dir, options.prefix_dir_bytes, options.prefix_min_tokens
            )
        )
        self.vocab = engine.vault.manifest.shape.vocab_size
        self.token_text = TokenText(engine.tokenizer)  # log-probabilities' token strings

    @property
    def limits(self) -> Limits:
        """What a request may ask of this model (the vocabulary, the longest reply)."""
        return Limits(vocab=self.vocab, max_tokens=min(MAX_TOKENS_LIMIT, self.engine.max_context))

    def settings(self, fields: dict[str, Any], prompt: int, chat: bool) -> RequestOptions:
        """The generation settings of validated ``fields`` for a ``prompt`` of so many
        tokens (smoe/serve/request_options.py); ApiError 400 if the reply has no room."""
        o = self.options
        return request_options(fields, prompt, chat, o, self.vocab, self.engine.max_context)

    def check_open(self) -> None:
        """SmoeError (a 503) if the engine is closed, so that a stream says so before its
        headers go out. The prompt itself the engine checks as the generation starts
        (``Engine.stream``); the API's checks before it gave each problem its 400."""
        if not self.engine.is_open:  # (the engine's own words: the server log is unchanged)
            raise SmoeError("the engine is not open: use 'async with Engine.open(...) as engine'")

    def check_queue(self) -> None:
        """ApiError 429 when ``max_queue`` requests wait for a place in the batch."""
        if self.engine.queued >= self.options.max_queue:
            raise ApiError(429, "too many requests are waiting; retry later", "rate_limit_error")

    async def answer(
        self,
        request: web.Request,
        fields: dict[str, Any],
        ids: list[int],
        format_: type[Format],
        chat: bool,
        turn: Turn | None = None,
        tools: list[dict[str, Any]] | None = None,
        echo: str | None = None,
    ) -> web.StreamResponse:
        """Generate for ``ids`` with the settings of validated ``fields`` and answer in
        ``format_``: its JSON body, or its stream of events as the tokens come. ``turn``:
        a plain chat's messages (the prefix cache may keep its reply); ``tools``: the
        request's tools (the model's calls are parsed out of its text); ``echo``: the
        prompt's text, given before the reply (completions' echo). ApiError 400 if the
        prompt is empty or too long for the context, 429 if the queue is full, SmoeError
        (503) if the engine is closed; a failure once streaming goes to the client as the
        format's error event. A client that disconnects cancels it (aiohttp's handler
        cancellation): the request leaves the batch at the next step."""
        if not ids:  # a text that tokenizes to nothing
            raise ApiError(400, "Invalid 'prompt': it encodes to no tokens.", param="prompt")
        opts = self.settings(fields, len(ids), chat)
        self.check_open()
        self.check_queue()
        splitter = ToolCallSplitter(self.engine.tokenizer, tools) if tools else None
        out = Completion(chat, StopMatcher(opts.stops), self.options.model_name, splitter)
        dress(out, fields, ids, echo, self.token_text)
        return await self._run(request, ids, opts, format_(out), turn)

    async def _run(
        self,
        request: web.Request,
        ids: list[int],
        opts: RequestOptions,
        fmt: Format,
        turn: Turn | None = None,
    ) -> web.StreamResponse:
        """Generate for one request and answer it in ``fmt``. Its sequence goes back to
        the prefix cache whatever happens."""
        seq = await self.take(ids)
        if turn is not None and turn.continued:
            self.counts.reply_follow_ups += 1
        reused = 0  # prompt tokens whose keys and values this request reuses

        def prepared(sequence: SequenceHandle, run: int) -> None:  # event loop (on_loop)
            nonlocal seq, reused
            seq = sequence
            reused = len(ids) - 1 - run  # the last prompt token runs in the first step
            self.counts.prepared(len(ids), run)

        out = fmt.out
        request_id = REQUEST_ID.get()
        kept: ChatReply | None = None  # what the prefix cache keeps of a chat reply
        response = None
        try:
            if opts.stream:  # (inside: a client gone before the headers is a 499 too)
                response = await open_stream(request, request_id, fmt.stream_type)
                await send(response, fmt.opening(len(ids), reused))
            await self.generate(ids, opts, seq, prepared, fmt, response)
            self.health.served()
            if turn is not None and seq is not None:
                try:  # only an optimisation: its failure is logged, never the request's
                    kept = kept_reply(
                        self.engine.tokenizer,
                        turn.messages,
                        ids,
                        seq,
                        out.generated,
                        out.reply,
                        out.ended,
                        out.stops.stopped,
                    )
                except Exception:
                    log.exception("request %s: the reply is not kept for reuse", request_id)
        except ConnectionError:
            if response is None:
                raise
            request[DROPPED] = True  # the client has gone: nobody to tell
            return response
        except Exception as e:
            if response is None:
                raise
            await stream_failure(response, fmt.failure(self.health.failure(e, request_id)))
            return response
        finally:
            if seq is not None:
                self.put_back(seq, kept)
            count_generated(out.completion)  # the access line's, whatever happened
            self.counts.prompt_tokens += len(ids)
            self.counts.generated_tokens += out.completion
        counted = out.usage(len(ids), reused)
        if response is None:
            return web.json_response(fmt.body(counted))
        await end_stream(response, fmt.closing(counted))
        return response

    async def take(self, ids: list[int]) -> SequenceHandle | None:
        """The cached sequence sharing the longest prefix with ``ids``: from memory, or
        from the disk store where its entry shares a longer one (SmoeError or OSError if
        reading that entry fails)."""
        in_memory = self.cache.longest(ids)
        if self.store is not None:
            seq, _ = await self.store.take(ids, have=in_memory)
            if seq is not None:
                return seq
        return self.cache.take(ids)[0]

    def put_back(self, seq: SequenceHandle, reply: ChatReply | None) -> None:
        """``seq`` back into the prefix cache (and the disk store, which copies what it
        keeps before anyone else may take it), with the chat ``reply`` it holds."""
        if self.store is not None:
            self.store.keep(seq)
        self.cache.put(seq, reply)

    async def generate(
        self,
        ids: list[int],
        opts: RequestOptions,
        seq: SequenceHandle | None,
        prepared: Prepared,
        fmt: Format,
        response: web.StreamResponse | None,
    ) -> None:
        """Feed the engine's events for ``ids`` (on ``seq``, a new sequence if None) into
        ``fmt.out`` until they end or a stop string does; each piece of text and each tool
        call goes to the client as events at once if ``response`` streams. ``prepared``
        runs on the event loop once the engine has pointed the sequence at the prompt
        (``on_loop``). Raises what the engine raises (SmoeError: the prompt, the engine
        closed; the vault or disk failing) and ConnectionError when the client has gone.
        A client that disconnects cancels this with its handler (aiohttp's handler
        cancellation); leaving frees the request's place in the batch."""
        out = fmt.out
        events = self.engine.stream(
            ids,
            opts.params,
            opts.max_tokens,
            sequence=seq,
            stop_at_eos=opts.stop_at_eos,
            on_prepared=on_loop(prepared),
        )
        async with contextlib.aclosing(events):  # leaving early frees the batch place
            async for event in events:
                piece = out.feed(event)
                calls = out.take_calls()
                if response is not None:
                    if piece:
                        await send(response, fmt.text(piece))
                    if calls:
                        await send(response, fmt.calls(calls))
                if out.stops.stopped:
                    break
