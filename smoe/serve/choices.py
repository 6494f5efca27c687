"""Answers of several choices in `smoe serve`: ``n`` > 1, and a list of prompts on
/v1/completions (what lm-evaluation-harness sends a batch as).

Each prompt's choices run together in the engine's batcher, each as a request of its own
(``Pipeline.generate``), so every choice is the answer its solo request would get: choice j
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
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from smoe.engine.handles import SequenceHandle
from smoe.serve.api_error import ApiError
from smoe.serve.completion import Completion, Usage, end_stream, open_stream, send, stream_failure
from smoe.serve.intake import off_loop
from smoe.serve.openai_format import OpenAIFormat
from smoe.serve.pipeline import Pipeline, Prepared, dress, on_loop
from smoe.serve.request_options import RequestOptions
from smoe.serve.request_scope import DROPPED, REQUEST_ID, count_generated
from smoe.serve.stops import StopMatcher
from smoe.serve.tools import ToolCallSplitter


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
    pipeline: Pipeline,
    request: web.Request,
    fields: dict[str, Any],
    prompts: list[list[int]],
    chat: bool,
    echoes: list[str | None] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> web.StreamResponse:
    """Answer ``fields["n"]`` choices for each of ``prompts`` in OpenAI's format (the
    module docstring). ApiError 400 for a prompt that is empty or too long, 429 if the
    queue is full, SmoeError (503) if the engine is closed; a failure once streaming goes
    to the client as the format's error event. A client that disconnects cancels every
    choice."""
    engine = pipeline.engine
    n = fields["n"]
    plans = []
    for p, ids in enumerate(prompts):
        if not ids:
            where = f"prompt[{p}]" if len(prompts) > 1 else "prompt"
            raise ApiError(400, f"Invalid '{where}': it encodes to no tokens.", param=where)
        opts = pipeline.settings(fields, len(ids), chat)
        pipeline.check_open()  # (the engine checks the prompt itself as it starts)
        plans.append((ids, opts))
    pipeline.check_queue()
    fmts: list[OpenAIFormat] = []
    for p, (ids, opts) in enumerate(plans):
        for j in range(n):
            splitter = ToolCallSplitter(engine.tokenizer, tools) if tools else None
            out = Completion(chat, StopMatcher(opts.stops), pipeline.options.model_name, splitter)
            out.index = p * n + j
            dress(out, fields, ids, echoes[p] if echoes else None, pipeline.token_text)
            fmt = OpenAIFormat(out)
            if fmts:  # one answer: one id, one time
                fmt.id, out.created = fmts[0].id, fmts[0].out.created
            fmts.append(fmt)
    request_id = REQUEST_ID.get()
    response = None
    reused: list[int] = [0] * len(plans)
    try:
        if fields["stream"]:
            response = await open_stream(request, request_id, fmts[0].stream_type)
        await _all(
            [
                _prompt(pipeline, ids, opts, fmts[p * n : (p + 1) * n], response, reused, p)
                for p, (ids, opts) in enumerate(plans)
            ]
        )
        pipeline.health.served()
    except ConnectionError:
        if response is None:
            raise
        request[DROPPED] = True
        return response
    except Exception as e:
        if response is None:
            raise
        await stream_failure(response, fmts[0].failure(pipeline.health.failure(e, request_id)))
        return response
    finally:
        generated = sum(f.out.completion for f in fmts)
        count_generated(generated)
        pipeline.counts.prompt_tokens += sum(len(ids) for ids, _ in plans)
        pipeline.counts.generated_tokens += generated
    usage = Usage(
        sum(len(ids) for ids, _ in plans), sum(f.out.completion for f in fmts), sum(reused)
    )
    if response is None:
        return web.json_response(fmts[0].envelope([f.choice() for f in fmts], usage.openai()))
    await end_stream(response, fmts[0].usage_chunk(usage.openai()))
    return response


async def _all(jobs: list[Coroutine[Any, Any, None]]) -> None:
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
    pipeline: Pipeline,
    ids: list[int],
    opts: RequestOptions,
    fmts: list[OpenAIFormat],
    response: web.StreamResponse | None,
    reused: list[int],
    p: int,
) -> None:
    """One prompt's choices (``fmts``); its sequence goes back to the prefix cache."""
    held: list[SequenceHandle | None] = [await pipeline.take(ids)]

    def count(sequence: SequenceHandle, run: int) -> None:  # event loop (on_loop)
        pipeline.counts.prepared(len(ids), run)

    def prepared(sequence: SequenceHandle, run: int) -> None:  # event loop (on_loop)
        held[0] = sequence
        reused[p] = len(ids) - 1 - run
        count(sequence, run)

    try:
        if len(fmts) == 1:
            await _choice(pipeline, ids, opts, held[0], prepared, fmts[0], response)
            return
        handles = await _prefill_and_copy(pipeline, ids, opts, held, prepared, fmts)
        params = dataclasses.replace(opts.params, prompt_logprobs=None)  # (done once)
        jobs = []
        for j, (fmt, handle) in enumerate(zip(fmts, handles, strict=True)):
            seed = params.seed + j if params.seed is not None else None
            mine = dataclasses.replace(opts, params=dataclasses.replace(params, seed=seed))
            counted = count if handle is None else _nothing  # a copy reuses the prefill
            jobs.append(_choice(pipeline, ids, mine, handle, counted, fmt, response))
        await _all(jobs)
    finally:
        seq = held[0]
        if seq is not None:
            pipeline.put_back(seq, None)


def _nothing(sequence: SequenceHandle, run: int) -> None:
    pass


async def _prefill_and_copy(
    pipeline: Pipeline,
    ids: list[int],
    opts: RequestOptions,
    held: list[SequenceHandle | None],
    prepared: Prepared,
    fmts: list[OpenAIFormat],
) -> list[SequenceHandle | None]:
    """Prefill ``ids`` once (a prompt-only request on ``held[0]``, which becomes the
    sequence it ran on; the prompt's numbers go to every choice that asked) and return a
    sequence per choice: that one, then copies of it (None each across ranks)."""
    engine = pipeline.engine
    params = dataclasses.replace(opts.params, logprobs=None)
    events = engine.stream(ids, params, 0, sequence=held[0], on_prepared=on_loop(prepared))
    async with contextlib.aclosing(events):
        async for event in events:
            if event.prompt_logprobs is not None:
                for fmt in fmts:
                    if fmt.out.logprobs is not None:
                        fmt.out.logprobs.prompt(ids, event.prompt_logprobs)
    base = held[0]
    if engine.group.leading or base is None:
        return [base] + [None] * (len(fmts) - 1)
    async with engine.exclusive():
        copies = [await engine.fork(base) for _ in fmts[1:]]
    return [base, *copies]


async def _choice(
    pipeline: Pipeline,
    ids: list[int],
    opts: RequestOptions,
    handle: SequenceHandle | None,
    prepared: Prepared,
    fmt: OpenAIFormat,
    response: web.StreamResponse | None,
) -> None:
    """One choice, and its last chunk where streaming."""
    await pipeline.generate(ids, opts, handle, prepared, fmt, response)
    if response is not None:
        await send(response, fmt.ending())
