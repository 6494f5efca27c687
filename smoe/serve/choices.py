"""Answers of several choices in `smoe serve`: ``n`` > 1, and a list of prompts on
/v1/completions (what lm-evaluation-harness sends a batch as).

Each prompt's choices run together in the engine's batcher, each as a request of its own
(``Server._generate``), so every choice is the answer its solo request would get: choice j
of a prompt samples with ``seed + j`` (choice 0 is the request's own seed's answer; no seed:
each draws freely), and greedy choices are all the same. With n > 1 a prompt is prefilled
once: a prompt-only request (max_tokens 0, which also computes the prompt's numbers where
``echo`` asks) and then a copy of its KV cache per choice (``Runner.copy``), so the choices
start decoding at once; reusing a prefix this way gives the same bits (docs/serve.md).
Across ranks (a leading engine) copies cannot be made: each choice then prefills its own.

Choices are numbered prompt-major (``index`` = prompt × n + j), as OpenAI does. Streamed,
each chunk carries one choice's text, each choice ends with its own chunk (its
``finish_reason``), and a last chunk of no choices carries the usage before ``[DONE]``.
The usage counts each prompt once and every choice's tokens. A client that disconnects
cancels every choice (each leaves the batch at the next step); a failure of one ends the
others and is answered as for one choice (docs/serve.md, errors).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

from aiohttp import web

from smoe.serve.api_error import ApiError
from smoe.serve.completion import (
    Completion,
    Format,
    Usage,
    end_stream,
    open_stream,
    send,
    stream_failure,
)
from smoe.serve.intake import off_loop
from smoe.serve.logprobs import LogprobLog, TokenText, asked
from smoe.serve.stops import StopMatcher
from smoe.serve.tools import ToolCallSplitter


def dress(
    out: Completion, fields: dict[str, Any], ids: list[int], echo: str | None, text: TokenText
) -> None:
    """Give ``out`` what the request asks beyond text: its numbers (``logprobs``) and the
    prompt's text before the reply (``echo``: the prompt as sent, or its ids decoded)."""
    if asked(fields, out.chat)[0] is not None:
        out.logprobs = LogprobLog(out.chat, text)
    out.echo, out.prompt_ids = echo, ids


async def echo_texts(
    tokenizer: Any, fields: dict[str, Any], prompts: list[str | list[int]]
) -> list[str | None]:
    """Each prompt's text where ``echo`` asks (ids decoded on a worker thread), else None."""
    if not fields.get("echo"):
        return [None] * len(prompts)

    def decode(ids: list[int]) -> str:
        text = tokenizer.decode(ids) if tokenizer is not None else ""
        return text if isinstance(text, str) else ""

    return [p if isinstance(p, str) else await off_loop(decode, p) for p in prompts]


async def answer(
    server: Any,
    request: web.Request,
    fields: dict[str, Any],
    prompts: list[list[int]],
    format_: type[Format],
    chat: bool,
    echoes: list[str | None] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> web.StreamResponse:
    """Answer ``fields["n"]`` choices for each of ``prompts`` in ``format_`` (the module
    docstring). ApiError 400 for a prompt that is empty or too long, 429 if the queue is
    full; a failure once streaming goes to the client as the format's error event."""
    from smoe.serve.app import DROPPED, _generated, _request_id

    n = fields["n"]
    plans = []
    for p, ids in enumerate(prompts):
        if not ids:
            where = f"prompt[{p}]" if len(prompts) > 1 else "prompt"
            raise ApiError(400, f"Invalid '{where}': it encodes to no tokens.", param=where)
        opts = server._options(fields, len(ids), chat)
        plans.append((server.engine.check_prompt(ids, extra=opts.max_tokens), opts))
    if server.engine.batcher.queued >= server.options.max_queue:
        raise ApiError(429, "too many requests are waiting; retry later", "rate_limit_error")
    fmts: list[Any] = []
    for p, (ids, opts) in enumerate(plans):
        for j in range(n):
            splitter = ToolCallSplitter(server.engine.tokenizer, tools) if tools else None
            out = Completion(chat, StopMatcher(opts.stops), server.options.model_name, splitter)
            out.index = p * n + j
            dress(out, fields, ids, echoes[p] if echoes else None, server.token_text)
            fmt: Any = format_(out)
            if fmts:  # one answer: one id, one time
                fmt.id, out.created = fmts[0].id, fmts[0].out.created
            fmts.append(fmt)
    request_id = _request_id.get()
    response = None
    reused: list[int] = [0] * len(plans)
    try:
        if fields["stream"]:
            response = await open_stream(request, request_id, fmts[0].stream_type)
        await _all(
            [
                _prompt(server, ids, opts, fmts[p * n : (p + 1) * n], response, reused, p)
                for p, (ids, opts) in enumerate(plans)
            ]
        )
        server.failing = None
    except ConnectionError:
        if response is None:
            raise
        request[DROPPED] = True
        return response
    except Exception as e:
        if response is None:
            raise
        await stream_failure(response, fmts[0].failure(server._failure(e, request_id)))
        return response
    finally:
        generated = sum(f.out.completion for f in fmts)
        _generated.get([]).append(generated)
        server.counts.prompt_tokens += sum(len(ids) for ids, _ in plans)
        server.counts.generated_tokens += generated
    usage = Usage(
        sum(len(ids) for ids, _ in plans), sum(f.out.completion for f in fmts), sum(reused)
    )
    if response is None:
        return web.json_response(fmts[0].envelope([f.choice() for f in fmts], usage.openai()))
    await end_stream(response, fmts[0].usage_chunk(usage.openai()))
    return response


async def _all(jobs: list[Any]) -> None:
    """Run ``jobs`` together; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _prompt(
    server: Any,
    ids: list[int],
    opts: Any,
    fmts: list[Any],
    response: web.StreamResponse | None,
    reused: list[int],
    p: int,
) -> None:
    """One prompt's choices (``fmts``); its sequence goes back to the prefix cache."""
    held: list[Any] = [await server._take(ids)]

    def count(sequence: Any, run: int) -> None:  # compute thread
        server.reused_tokens += len(ids) - 1 - run
        server.prefilled_tokens += run

    def prepared(sequence: Any, run: int) -> None:  # compute thread
        held[0] = sequence
        reused[p] = len(ids) - 1 - run
        count(sequence, run)

    try:
        if len(fmts) == 1:
            await _choice(server, ids, opts, held[0], prepared, fmts[0], response)
            return
        handles = await _prefill_and_copy(server, ids, opts, held, prepared, fmts)
        params = dataclasses.replace(opts.params, prompt_logprobs=None)  # (done once)
        jobs = []
        for j, (fmt, handle) in enumerate(zip(fmts, handles, strict=True)):
            seed = params.seed + j if params.seed is not None else None
            mine = dataclasses.replace(opts, params=dataclasses.replace(params, seed=seed))
            counted = count if handle is None else _nothing  # a copy reuses the prefill
            jobs.append(_choice(server, ids, mine, handle, counted, fmt, response))
        await _all(jobs)
    finally:
        seq = held[0]
        if seq is not None:
            if server.store is not None:
                server.store.keep(seq)
            server.cache.put(seq, None)


def _nothing(sequence: Any, run: int) -> None:
    pass


async def _prefill_and_copy(
    server: Any,
    ids: list[int],
    opts: Any,
    held: list[Any],
    prepared: Callable[[Any, int], None],
    fmts: list[Any],
) -> list[Any]:
    """Prefill ``ids`` once (a prompt-only request on ``held[0]``, which becomes the
    sequence it ran on; the prompt's numbers go to every choice that asked) and return a
    sequence per choice: that one, then copies of it (None each across ranks)."""
    engine = server.engine
    params = dataclasses.replace(opts.params, logprobs=None)
    events = engine.stream(ids, params, 0, sequence=held[0], on_prepared=prepared)
    async with contextlib.aclosing(events):
        async for event in events:
            if event.prompt_logprobs is not None:
                for fmt in fmts:
                    if fmt.out.logprobs is not None:
                        fmt.out.logprobs.prompt(ids, event.prompt_logprobs)
    base = held[0]
    if engine.leader is not None or base is None:
        return [base] + [None] * (len(fmts) - 1)
    async with engine.exclusive():
        copies = [await engine.compute.run(engine.runner.copy, base) for _ in fmts[1:]]
    return [base, *copies]


async def _choice(
    server: Any,
    ids: list[int],
    opts: Any,
    handle: Any,
    prepared: Callable[[Any, int], None],
    fmt: Any,
    response: web.StreamResponse | None,
) -> None:
    """One choice, and its last chunk where streaming."""
    await server._generate(ids, opts, handle, prepared, fmt, response)
    if response is not None:
        await send(response, fmt.ending())
