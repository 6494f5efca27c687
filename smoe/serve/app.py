"""`smoe serve`: an OpenAI-compatible HTTP server (aiohttp on uvloop) over one Engine.

Endpoints: POST /v1/chat/completions (JSON or server-sent events), POST /v1/completions,
GET /v1/models, GET /health, GET /v1/smoe/stats. Errors use OpenAI's error format.

Concurrent requests are decoded together by the engine's batcher (one step advances every
active request; per MoE layer the union of their experts is read once), with results
identical to running each alone. A request whose prompt extends an earlier one reuses
that request's KV cache (prefix reuse). A client that disconnects leaves the batch at the
next step. Requests beyond the batch wait in a bounded queue; past it they get 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from smoe.compute.runner import SamplingParams, Sequence_, common_prefix
from smoe.engine import Engine
from smoe.errors import SmoeError
from smoe.serve.stops import StopMatcher

MAX_TOKENS_LIMIT = 32768
log = logging.getLogger("smoe.serve")


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )

    def response(self) -> web.Response:
        body = {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
        return web.json_response(body, status=self.status)


@dataclass
class ServerOptions:
    api_key: str | None = None
    max_queue: int = 16  # requests waiting for a place in the batch; more get 429
    model_name: str = "smoe"
    cached_sequences: int = 8  # KV caches kept for prefix reuse
    cached_bytes: int = 2 * 1024**3  # and at most this much of their keys and values
    prewarm_when_idle: bool = True  # read the hottest experts into empty slots when idle


@dataclass
class RequestOptions:
    max_tokens: int
    params: SamplingParams
    stream: bool
    stops: list[str]
    stop_at_eos: bool


def _text_content(content: Any) -> str | None:
    """A message's content: a string, or OpenAI's list of parts (text parts only)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return "\n".join(part["text"] for part in content)
    return None


@dataclass
class PrefixCache:
    """KV caches of recent requests; a new prompt takes the one sharing its longest prefix.
    Keeps at most ``capacity`` caches and ``max_bytes`` of keys and values (oldest go)."""

    capacity: int
    max_bytes: int = 2 * 1024**3
    entries: list[Sequence_] = field(default_factory=list)

    def take(self, prompt: list[int]) -> tuple[Sequence_ | None, int]:
        best, best_len = None, 0
        for seq in self.entries:
            n = common_prefix(seq.tokens[: seq.cached], prompt)
            if n > best_len:
                best, best_len = seq, n
        if best is not None:
            self.entries.remove(best)
        return best, best_len

    def put(self, seq: Sequence_) -> None:
        self.entries.insert(0, seq)
        del self.entries[self.capacity :]
        while self.entries and self.nbytes() > self.max_bytes:
            self.entries.pop()

    def nbytes(self) -> int:
        return sum(_cache_bytes(seq) for seq in self.entries)


def _cache_bytes(seq: Sequence_) -> int:
    return sum(int(getattr(c, "nbytes", 0)) for c in seq.cache)


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise ApiError(400, f"'{name}' must be a number", param=name)
    if not isinstance(value, kind):
        raise ApiError(400, f"'{name}' has the wrong type", param=name)
    return value


class Server:
    """The HTTP front of one engine."""

    def __init__(self, engine: Engine, options: ServerOptions) -> None:
        self.engine = engine
        self.options = options
        self.cache = PrefixCache(options.cached_sequences, options.cached_bytes)
        self.reused_tokens = 0
        self.app = web.Application(middlewares=[self._errors, self._auth])
        self.app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/v1/models", self.models),
                web.get("/v1/smoe/stats", self.stats),
                web.post("/v1/chat/completions", self.chat),
                web.post("/v1/completions", self.completions),
            ]
        )

    # ------------------------------------------------------------- middleware
    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            return e.response()
        except SmoeError as e:
            return ApiError(400, str(e)).response()
        except web.HTTPException as e:
            return ApiError(e.status, e.reason or "error").response()
        except Exception as e:  # a fault of ours (an I/O error, a bug): say so, keep serving
            log.exception("request failed")
            return ApiError(500, f"internal error: {e}", "server_error").response()

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        key = self.options.api_key
        authorized = request.headers.get("Authorization", "") == f"Bearer {key}"
        if key and request.path != "/health" and not authorized:
            raise ApiError(
                401, "missing or wrong API key", "authentication_error", code="invalid_api_key"
            )
        return await handler(request)

    # ------------------------------------------------------------- small endpoints
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.options.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "smoe",
                    }
                ],
            }
        )

    async def stats(self, request: web.Request) -> web.Response:
        sched, batcher = self.engine.scheduler, self.engine.batcher
        return web.json_response(
            {
                "scheduler": sched.stats.to_json(),
                "ring": {"slots": sched.num_slots, "filled": sched.fill()},
                "queues": {
                    "demand": sched.queue_depth(0),
                    "speculative": sched.queue_depth(1),
                    "in_flight": sched.in_flight,
                },
                "batch": {
                    "active": len(batcher.active),
                    "waiting": batcher.queued,
                    "max_batch": batcher.max_batch,
                    "steps": batcher.steps,
                    "mean_rows_per_step": batcher.step_rows / batcher.steps
                    if batcher.steps
                    else 0.0,
                },
                "prefix_reused_tokens": self.reused_tokens,
                "prefix_cache": {
                    "sequences": len(self.cache.entries),
                    "bytes": self.cache.nbytes(),
                    "max_bytes": self.cache.max_bytes,
                },
            }
        )

    # ------------------------------------------------------------- completions
    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    def _options(self, body: dict[str, Any]) -> RequestOptions:
        """The generation settings of a request; ApiError 400 names the bad field."""
        max_tokens = _field(body, "max_tokens", int, None)
        if max_tokens is None:
            max_tokens = _field(body, "max_completion_tokens", int, 256)
        if not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
            raise ApiError(
                400, f"max_tokens must be between 1 and {MAX_TOKENS_LIMIT}", param="max_tokens"
            )
        number = (int, float)
        params = SamplingParams(
            temperature=float(_field(body, "temperature", number, 1.0)),
            top_p=float(_field(body, "top_p", number, 1.0)),
            top_k=_field(body, "top_k", int, 0),  # vLLM's extensions: top_k, min_p,
            min_p=float(_field(body, "min_p", number, 0.0)),  # repetition_penalty
            repetition_penalty=float(_field(body, "repetition_penalty", number, 1.0)),
            presence_penalty=float(_field(body, "presence_penalty", number, 0.0)),
            frequency_penalty=float(_field(body, "frequency_penalty", number, 0.0)),
            seed=_field(body, "seed", int, None),
        )
        try:
            params.check()
        except SmoeError as e:
            raise ApiError(400, str(e)) from None
        if _field(body, "n", int, 1) != 1:
            raise ApiError(400, "only n=1 is supported", param="n")
        for name in ("logprobs", "tools", "functions"):
            if body.get(name):
                raise ApiError(400, f"'{name}' is not supported by this server", param=name)
        stop = _field(body, "stop", (str, list), [])
        stops = [stop] if isinstance(stop, str) else stop
        if len(stops) > 4 or not all(isinstance(x, str) and x for x in stops):
            raise ApiError(
                400, "'stop' must be a string or up to 4 non-empty strings", param="stop"
            )
        return RequestOptions(
            max_tokens=max_tokens,
            params=params,
            stream=_field(body, "stream", bool, False),
            stops=stops,
            stop_at_eos=not _field(body, "ignore_eos", bool, False),  # vLLM's extension
        )

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        messages = body.get("messages")
        turns = (
            [
                {"role": m.get("role"), "content": _text_content(m.get("content"))}
                for m in messages
                if isinstance(m, dict)
            ]
            if isinstance(messages, list)
            else []
        )
        if (
            not turns
            or len(turns) != len(messages)
            or not all(isinstance(t["role"], str) and t["content"] is not None for t in turns)
        ):
            raise ApiError(
                400,
                "'messages' must be a non-empty list of {role, content}, content being text "
                "or a list of text parts",
                param="messages",
            )
        if self.engine.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer; use /v1/completions with ids")
        ids = self.engine.tokenizer.apply_chat_template(
            turns,
            add_generation_prompt=True,
            tokenize=True,
        )
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        return await self._complete(request, body, ids, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = self.engine.encode(prompt)
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            ids = list(prompt)
        else:
            raise ApiError(400, "'prompt' must be a string or a list of token ids", param="prompt")
        return await self._complete(request, body, ids, chat=False)

    async def _complete(
        self, request: web.Request, body: dict[str, Any], ids: list[int], chat: bool
    ) -> web.StreamResponse:
        opts = self._options(body)
        try:
            ids = self.engine._check_tokens(ids, extra=opts.max_tokens)
        except SmoeError as e:
            raise ApiError(400, str(e), code="context_length_exceeded") from None
        if self.engine.batcher.queued >= self.options.max_queue:
            raise ApiError(429, "too many requests are waiting; retry later", "rate_limit_error")
        return await self._run(request, ids, opts, chat)

    async def _run(
        self, request: web.Request, ids: list[int], opts: RequestOptions, chat: bool
    ) -> web.StreamResponse:
        engine = self.engine
        seq, reused = self.cache.take(ids)
        self.reused_tokens += reused

        def prepare() -> Sequence_:  # compute thread; the batcher prefills the rest
            nonlocal seq
            if seq is None:
                seq = Sequence_(cache=engine.runner.new_cache())
            engine.runner.prepare(seq, ids, opts.params)
            return seq

        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        text: list[str] = []
        finish, completion = "length", 0
        response: web.StreamResponse | None = None
        stops = StopMatcher(opts.stops)
        if opts.stream:
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await response.prepare(request)
        try:
            events = engine._stream(prepare, len(ids), opts.max_tokens, opts.stop_at_eos)
            async with contextlib.aclosing(events):  # leaving early frees the batch place
                async for event in events:
                    if event.token is not None:
                        completion += 1
                    if event.finish_reason:
                        finish = event.finish_reason
                    piece = stops.feed(event.text) if event.text else ""
                    if stops.stopped:
                        finish = "stop"
                    elif event.finish_reason:
                        piece += stops.flush()
                    if piece:
                        text.append(piece)
                        if response is not None:
                            await self._sse(response, rid, kind, created, piece, None, chat)
                    if stops.stopped:
                        break
        except Exception as e:
            if response is None:
                raise
            # The stream has begun (status 200 sent): the error goes as an event.
            log.exception("generation failed")
            err = ApiError(500, f"internal error: {e}", "server_error")
            error = {"message": err.message, "type": err.type, "param": None, "code": None}
            await response.write(f"data: {json.dumps({'error': error})}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            if seq is not None:
                self.cache.put(seq)
        usage = {
            "prompt_tokens": len(ids),
            "completion_tokens": completion,
            "total_tokens": len(ids) + completion,
        }
        if response is not None:
            await self._sse(response, rid, kind, created, "", finish, chat, usage)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        reply = "".join(text)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": reply}
        else:
            choice["text"] = reply
        return web.json_response(
            {
                "id": rid,
                "object": kind,
                "created": created,
                "model": self.options.model_name,
                "choices": [choice],
                "usage": usage,
            }
        )

    async def _sse(
        self,
        response: web.StreamResponse,
        rid: str,
        kind: str,
        created: int,
        text: str,
        finish: str | None,
        chat: bool,
        usage: dict[str, int] | None = None,
    ) -> None:
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": text} if text else {},
                "finish_reason": finish,
            }
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish}
            obj = kind
        chunk: dict[str, Any] = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": self.options.model_name,
            "choices": [choice],
        }
        if usage is not None:
            chunk["usage"] = usage
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())


async def serve(
    engine: Engine,
    host: str,
    port: int,
    options: ServerOptions,
    ready: Any = None,
    server: Server | None = None,
) -> None:
    """Serve until cancelled; ``ready(port)`` is called once listening (port 0 picks one).
    A client that disconnects cancels its handler (and so its generation after the step
    in progress). ``server``: a Server made by the caller (benchmarks inspect it)."""
    server = server or Server(engine, options)
    if options.prewarm_when_idle:
        engine.batcher.on_idle = engine.prewarm
    runner = web.AppRunner(server.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    if options.prewarm_when_idle:
        engine.prewarm()  # idle from the start
    if ready is not None:
        sockets = site._server.sockets if site._server is not None else []  # type: ignore[union-attr]
        ready(sockets[0].getsockname()[1] if sockets else port)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
