"""`smoe serve`: an OpenAI-, Anthropic- and Ollama-compatible HTTP server (aiohttp on
uvloop) over one Engine.

Endpoints: POST /v1/chat/completions (JSON or server-sent events), POST /v1/completions,
GET /v1/models, GET /health, GET /v1/smoe/stats; Anthropic's POST /v1/messages
(smoe/serve/anthropic_api.py) and Ollama's /api/chat, /api/generate, /api/tags
(smoe/serve/ollama_api.py). Every API goes through one pipeline: its request checked into
the same fields, the prompt's ids (the chat template, with tools), ``answer`` (the engine's
events into a ``Completion``), and the API's ``Format`` for the body or the stream's events.
Errors take the shape of the route's API: a 4xx naming the field for a bad request
(smoe/serve/body.py checks the body, validate.py every field), 503 when the engine cannot
serve (its vault or disk failing), 500 only for a bug of ours; a 5xx tells the client a
request id, never internals, and the server log has the details (smoe/serve/api_error.py).

Concurrent requests are decoded together by the engine's batcher (one step advances every
active request; per MoE layer the union of their experts is read once), with results
identical to running each alone. A request whose prompt extends an earlier one reuses
that request's KV cache (prefix reuse); a chat request that sends back a reply of ours
verbatim continues from the ids that reply was generated as (``PrefixCache.follow_up``),
so only its new messages are prefilled. A client that disconnects leaves the batch at the
next step. Requests beyond the batch wait in a bounded queue; past it they get 429.

The server starts no tasks of its own: aiohttp runs each request in its task and cancels
it when its client disconnects; the waits with a limit (a request body) are anyio cancel
scopes, so a cancellation from outside passes through them untouched.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import errno
import gc
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from smoe.engine import Engine
from smoe.engine.handles import SequenceHandle
from smoe.engine.prefix_store import MIN_TOKENS, PrefixStore
from smoe.errors import ShuttingDown, SmoeError
from smoe.sampling import SamplingParams
from smoe.serve import anthropic_api, choices, cors, ollama_api, openai_api
from smoe.serve.api_error import ApiError, failure, http_error
from smoe.serve.body import MAX_BODY_BYTES
from smoe.serve.completion import (
    Completion,
    Format,
    end_stream,
    open_stream,
    send,
    stream_failure,
)
from smoe.serve.guard import Guard, key_matches, sent_key
from smoe.serve.intake import (
    READ_BUFSIZE,
    REQUEST_MEMORY,
    off_loop,
)
from smoe.serve.listener import listen
from smoe.serve.logprobs import TokenText, asked
from smoe.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from smoe.serve.metrics import render as render_metrics
from smoe.serve.prefix import ChatReply, PrefixCache, reply_ids
from smoe.serve.prompt import Intake, Turn
from smoe.serve.stats import model_created, server_stats
from smoe.serve.stops import StopMatcher
from smoe.serve.tools import ToolCallSplitter
from smoe.serve.validate import Limits, validate_request

__all__ = ["Server", "ServerOptions", "serve"]
T = TypeVar("T")

MAX_TOKENS_LIMIT = 32768
log = logging.getLogger("smoe.serve")
_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class _MalformedHttp(logging.Filter):
    """aiohttp answers malformed HTTP (a line too long, a bad chunk) with a 400 and logs
    it with a traceback at ERROR; it is the client's fault, so: one line at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        if not http_log.isEnabledFor(logging.DEBUG):
            return False
        record.msg = f"{record.getMessage()}: 400 {_line(exc.message)}"
        record.args, record.exc_info = None, None
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


http_log = logging.getLogger("smoe.serve.http")  # aiohttp's protocol messages
access_log = logging.getLogger("smoe.serve.access")  # a line per request (Server._access)
# The tokens the request in this task generated, for its access line (set by Server._run)
_generated: contextvars.ContextVar[list[int]] = contextvars.ContextVar("smoe_generated")
# Set on a request whose client went away: its access line says 499
DROPPED = web.RequestKey("smoe_dropped", bool)
http_log.addFilter(_MalformedHttp())


@dataclass
class ServerOptions:
    api_key: str | None = None  # compared in constant time (smoe/serve/guard.py)
    # Host and Origin rules (smoe/serve/guard.py); None: the bind address's defaults
    guard: Guard | None = None
    max_queue: int = 16  # requests waiting for a place in the batch; more get 429
    model_name: str = "smoe"
    cached_sequences: int = 8  # KV caches kept for prefix reuse
    cached_bytes: int = 2 * 1024**3  # and at most this much of their keys and values
    # Long prompts' KV caches on disk, kept across restarts (smoe/engine/prefix_store.py)
    prefix_dir: Path | None = None
    prefix_dir_bytes: int = 8 * 1024**3
    prefix_min_tokens: int = MIN_TOKENS
    prewarm_when_idle: bool = True  # read the hottest experts into empty slots when idle
    max_body_bytes: int = MAX_BODY_BYTES  # larger request bodies get 413
    # Bodies arriving and requests being prepared hold at most this (smoe/serve/intake.py)
    request_memory: int = REQUEST_MEMORY
    body_timeout_s: float = 60.0  # a body slower than this gets 408 (a stalled client)
    # What a request that does not say gets (`smoe serve --temp/--top-p/--max-tokens`,
    # else the model's generation_config; greedy as mlx_lm.server without either).
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 256  # at most what the context has room for
    # Stopping: end the engine's requests in flight (each stream sends an error event),
    # then wait at most shutdown_s for the handlers to finish writing.
    end_requests_on_stop: bool = True
    shutdown_s: float = 10.0
    # A socket idle this long (nothing sent yet, or between requests) is closed; past
    # max_connections open at once a new one gets 503 and is closed (smoe/serve/listener.py).
    idle_timeout_s: float = 30.0
    max_connections: int = 128  # each holds up to intake.CONNECTION_BYTES, in the plan


@dataclass
class ServerCounts:
    """What /metrics counts: requests answered by status, and their tokens."""

    by_status: collections.Counter[int] = field(default_factory=collections.Counter)
    prompt_tokens: int = 0
    generated_tokens: int = 0


@dataclass
class RequestOptions:
    max_tokens: int  # not sent: as many as the context has room for, up to 256
    params: SamplingParams
    stream: bool
    stops: list[str]
    stop_at_eos: bool


def error_json(path: str, e: ApiError) -> dict[str, Any]:
    """``e`` in the error shape of the API that ``path`` belongs to."""
    if path.startswith("/v1/messages"):
        return anthropic_api.error_json(e)
    if path.startswith("/api/"):
        return ollama_api.error_json(e)
    return openai_api.error_json(e)


def error_response(path: str, e: ApiError) -> web.Response:
    """``e`` as the response of the API that ``path`` belongs to."""
    return web.json_response(error_json(path, e), status=e.status)


class Server:
    """The HTTP front of one engine."""

    def __init__(self, engine: Engine, options: ServerOptions) -> None:
        self.engine = engine
        self.options = options
        self.cache = PrefixCache(options.cached_sequences, options.cached_bytes)
        self.store = (
            None
            if options.prefix_dir is None
            else PrefixStore(
                engine, options.prefix_dir, options.prefix_dir_bytes, options.prefix_min_tokens
            )
        )
        self.reused_tokens = 0  # prompt tokens whose keys and values were reused
        self.prefilled_tokens = 0  # prompt tokens run (all but each prompt's last)
        self.reply_follow_ups = 0  # chat requests that continued a cached reply's ids
        self.counts = ServerCounts()
        # Who may talk to us; serve() sets it from the bind address unless options say.
        self.guard = options.guard or Guard(loopback_only=False)
        # Why the last request that failed for the server's sake failed (a 503), until a
        # request succeeds again: /health reports it.
        self.failing: str | None = None
        self.app = web.Application(
            middlewares=[self._access, self._errors, self._auth],
            client_max_size=options.max_body_bytes,
        )
        self.app.on_response_prepare.append(self._cors_headers)
        self.vocab = engine.vault.manifest.shape.vocab_size
        self.token_text = TokenText(engine.tokenizer)  # log-probabilities' token strings
        # Requests into prompts, within the request memory (smoe/serve/prompt.py)
        self.intake = Intake(
            engine,
            self.cache,
            max_queue=options.max_queue,
            max_body_bytes=options.max_body_bytes,
            body_timeout_s=options.body_timeout_s,
            request_memory=options.request_memory,
        )
        self.app.add_routes(
            [
                web.get("/", self.root),
                web.get("/health", self.health),
                web.get("/metrics", self.metrics),
                web.get("/v1/models", self.models),
                web.get("/v1/smoe/stats", self.stats),
                web.post("/v1/chat/completions", self.chat),
                web.post("/v1/completions", self.completions),
                *anthropic_api.routes(self),
                *ollama_api.routes(self),
            ]
        )

    # ------------------------------------------------------------- middleware
    @web.middleware
    async def _access(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """One log line per request (INFO on logger smoe.serve.access): method, path,
        status, seconds, generated tokens; never a key, a prompt or a reply."""
        start = time.perf_counter()
        status = 499  # the client went away before an answer (nginx's code)
        generated: list[int] = []
        _generated.set(generated)  # the handler runs in this task: it appends to it
        try:
            response: web.StreamResponse = await handler(request)
            status = 499 if request.get(DROPPED) else response.status
            return response
        finally:
            self.counts.by_status[status] += 1
            tokens = sum(generated) if generated else None
            access_log.info(
                "%s %s %d %.3fs%s",
                request.method,
                request.path,
                status,
                time.perf_counter() - start,
                f" {tokens} tokens" if tokens is not None else "",
            )

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        rid = "req_" + uuid.uuid4().hex[:20]
        _request_id.set(rid)  # the handler runs in this task: it sees the id
        response: web.StreamResponse
        try:
            response = await handler(request)
        except ApiError as e:
            response = error_response(request.path, e)
            if e.status == 408:  # the body stalled: answer, then close at once (else
                # aiohttp waits up to 10 s more for the body before closing)
                response.headers["X-Request-Id"] = rid
                await response.prepare(request)
                await response.write_eof()
                request.protocol.force_close()
        except web.HTTPException as e:
            if e.status < 400:
                raise
            response = error_response(
                request.path, http_error(request, e, self.options.max_body_bytes)
            )
        except ConnectionError:  # the client has gone: nobody to answer (aiohttp's write
            # of this response fails quietly); the access line says 499
            request[DROPPED] = True
            response = web.Response(status=499)
        except Exception as e:  # not the request's fault: keep serving, tell no internals
            response = error_response(request.path, self._failure(e, rid))
        if not response.prepared:  # a stream has sent its headers already, with the id
            response.headers["X-Request-Id"] = rid
        return response

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        refusal = self.guard.refusal(request.headers.get("Host"), request.headers.get("Origin"))
        if refusal is not None:
            raise ApiError(403, refusal, "permission_error", code="forbidden_origin")
        key = self.options.api_key
        if request.method == "OPTIONS" and _route_exists(request):
            # a preflight: browsers send no key with it (smoe/serve/cors.py)
            if cors.is_preflight(request):
                return cors.preflight(request)
            return web.Response(status=204, headers={"Allow": cors.METHODS})
        if key and request.path not in ("/", "/health"):
            sent = sent_key(request.headers.get("Authorization"), request.headers.get("x-api-key"))
            if sent is None or not key_matches(key, sent):
                raise ApiError(
                    401, "missing or wrong API key", "authentication_error", code="invalid_api_key"
                )
        response: web.StreamResponse = await handler(request)
        return response

    async def _cors_headers(self, request: web.BaseRequest, response: web.StreamResponse) -> None:
        cors.add_headers(self.guard, request, response)

    def _failure(self, e: Exception, rid: str) -> ApiError:
        """``failure(e, rid)``, remembered for /health when it is the server's (a 503)."""
        err = failure(e, rid)
        if err.status == 503:
            # the class only: /health needs no key, the details stay in the server log
            self.failing = f"the last request failed: {type(e).__name__} (see the server log)"
        return err

    # ------------------------------------------------------------- small endpoints
    async def health(self, request: web.Request) -> web.Response:
        """200 when the engine can take requests, else 503 with why: the engine closed, or
        the last request failed for the server's sake (its vault or disk) and none has
        succeeded since. Needs no key."""
        why = "the engine is closed" if not self.engine.is_open else self.failing
        if why is not None:
            return web.json_response({"status": "unavailable", "why": why}, status=503)
        batch = self.engine.stats().batch
        return web.json_response(
            {
                "status": "ok",
                "model": self.options.model_name,
                "active": batch.active,
                "waiting": batch.waiting,
                "max_batch": batch.max_batch,
                "max_queue": self.options.max_queue,
            }
        )

    async def root(self, request: web.Request) -> web.Response:
        """What a browser or `curl URL` sees: that it runs, which model, where the APIs are."""
        return web.json_response(
            {
                "status": "S-MoE is running",
                "model": self.options.model_name,
                "apis": {"openai": "/v1", "anthropic": "/v1/messages", "ollama": "/api"},
                "stats": "/v1/smoe/stats",
                "metrics": "/metrics",
            }
        )

    async def metrics(self, request: web.Request) -> web.Response:
        body = render_metrics(self)
        return web.Response(text=body, headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.options.model_name,
                        "object": "model",
                        "created": model_created(self.engine.vault),
                        "owned_by": "smoe",
                    }
                ],
            }
        )

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(await server_stats(self))

    # ------------------------------------------------------------- completions
    @property
    def limits(self) -> Limits:
        """What a request may ask of this model (the vocabulary, the longest reply)."""
        return Limits(vocab=self.vocab, max_tokens=min(MAX_TOKENS_LIMIT, self.engine.max_context))

    async def _request(self, request: web.Request, endpoint: str) -> dict[str, Any]:
        """The request's fields, validated (smoe/serve/validate.py); ApiError 4xx if not."""
        async with self.intake.preparing(request) as body:
            return await off_loop(validate_request, body, endpoint, self.limits)

    async def read_body(self, request: web.Request) -> dict[str, Any]:
        """The request's JSON object, checked as ``preparing`` does (for a request that
        is not templated)."""
        async with self.intake.preparing(request) as body:
            return body

    def _options(self, fields: dict[str, Any], prompt: int, chat: bool) -> RequestOptions:
        """The generation settings of validated ``fields`` for a ``prompt`` of so many
        tokens; ApiError 400 (context_length_exceeded) if the reply has no room."""
        top_k = fields["top_k"]
        logprobs, prompt_logprobs = asked(fields, chat)
        o = self.options
        temperature = o.temperature if fields["temperature"] is None else fields["temperature"]
        top_p = o.top_p if fields["top_p"] is None else fields["top_p"]
        params = SamplingParams(
            # top_p 0 keeps only the likeliest token, which is greedy decoding
            temperature=0.0 if top_p == 0 else temperature,
            top_p=top_p or 1.0,
            top_k=0 if top_k < 0 or top_k >= self.vocab else top_k,  # all tokens: off
            min_p=fields["min_p"],
            repetition_penalty=fields["repetition_penalty"],
            presence_penalty=fields["presence_penalty"],
            frequency_penalty=fields["frequency_penalty"],
            seed=fields["seed"],
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=fields.get("logit_bias", ()),
        )
        try:
            params.check()  # validation is stricter; this guards against drift
        except SmoeError as e:
            raise ApiError(400, str(e)) from None
        room = self.engine.max_context - prompt
        max_tokens = fields["max_tokens"]  # (0: with echo, the prompt only)
        if max_tokens is None:
            max_tokens = fields["max_completion_tokens"]
        if max_tokens is None:
            max_tokens = max(1, min(o.max_tokens, room))
        if max_tokens > room:
            raise ApiError(
                400,
                f"{prompt} prompt tokens + {max_tokens} to generate exceed the context "
                f"of {self.engine.max_context} tokens; shorten the prompt or lower max_tokens",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        return RequestOptions(
            max_tokens=max_tokens,
            params=params,
            stream=fields["stream"],
            stops=fields["stop"],
            stop_at_eos=not fields["ignore_eos"],  # vLLM's extension
        )

    async def chat(self, request: web.Request) -> web.StreamResponse:
        async with self.intake.preparing(request) as body:
            fields = await off_loop(validate_request, body, "chat", self.limits)
            tools = fields["tools"] if fields["tool_choice"] != "none" else []
            ids, turn = await self.intake.template(fields["messages"], tools)
        if fields["n"] > 1:  # several choices (smoe/serve/choices.py)
            fmt = openai_api.OpenAIFormat
            return await choices.answer(self, request, fields, [ids], fmt, True, tools=tools)
        return await self.answer(
            request, fields, ids, openai_api.OpenAIFormat, chat=True, turn=turn, tools=tools
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        async with self.intake.preparing(request) as body:
            fields = await off_loop(validate_request, body, "completions", self.limits)
            prompts = fields["prompt"]  # one or more (smoe/serve/choices.py)
            ids = [await self.intake.encode(p) if isinstance(p, str) else p for p in prompts]
            echoes = await choices.echo_texts(self.engine.tokenizer, fields, prompts)
        fmt = openai_api.OpenAIFormat
        if len(ids) > 1 or fields["n"] > 1:
            return await choices.answer(self, request, fields, ids, fmt, False, echoes)
        return await self.answer(request, fields, ids[0], fmt, chat=False, echo=echoes[0])

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
        prompt's text, given before the reply (completions' echo). ApiError 400 if
        the prompt is empty or too long for the context, 429 if the queue is full; a
        failure once streaming goes to the client as the format's error event."""
        if not ids:  # a text that tokenizes to nothing
            raise ApiError(400, "Invalid 'prompt': it encodes to no tokens.", param="prompt")
        opts = self._options(fields, len(ids), chat)
        # validation checked the ids and the length: only a closed engine fails here (503)
        ids = self.engine.check_prompt(ids, extra=opts.max_tokens)
        if self.engine.batcher.queued >= self.options.max_queue:
            raise ApiError(429, "too many requests are waiting; retry later", "rate_limit_error")
        splitter = ToolCallSplitter(self.engine.tokenizer, tools) if tools else None
        out = Completion(chat, StopMatcher(opts.stops), self.options.model_name, splitter)
        choices.dress(out, fields, ids, echo, self.token_text)
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
        seq = await self._take(ids)
        if turn is not None and turn.continued:
            self.reply_follow_ups += 1
        reused = 0  # prompt tokens whose keys and values this request reuses

        def prepared(sequence: SequenceHandle, run: int) -> None:  # compute thread
            nonlocal seq, reused
            seq = sequence
            reused = len(ids) - 1 - run  # the last prompt token runs in the first step
            self.reused_tokens += reused  # counters written by the compute thread only
            self.prefilled_tokens += run

        out = fmt.out
        request_id = _request_id.get()
        kept: ChatReply | None = None  # what the prefix cache keeps of a chat reply
        response = None
        try:
            if opts.stream:  # (inside: a client gone before the headers is a 499 too)
                response = await open_stream(request, request_id, fmt.stream_type)
                await send(response, fmt.opening(len(ids), reused))
            await self._generate(ids, opts, seq, prepared, fmt, response)
            self.failing = None  # a generation went through: the engine serves again
            if turn is not None and seq is not None:
                try:  # only an optimisation: its failure is logged, never the request's
                    kept = self._reply(
                        turn, ids, seq, out.generated, out.reply, out.ended, out.stops.stopped
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
            await stream_failure(response, fmt.failure(self._failure(e, request_id)))
            return response
        finally:
            if seq is not None:
                if self.store is not None:
                    self.store.keep(seq)  # (before anyone else may take it)
                self.cache.put(seq, kept)
            _generated.get([]).append(out.completion)  # the access line's, whatever happened
            self.counts.prompt_tokens += len(ids)
            self.counts.generated_tokens += out.completion
        counted = out.usage(len(ids), reused)
        if response is None:
            return web.json_response(fmt.body(counted))
        await end_stream(response, fmt.closing(counted))
        return response

    async def _take(self, ids: list[int]) -> SequenceHandle | None:
        """The cached sequence sharing the longest prefix with ``ids``: from memory, or
        from the disk store where its entry shares a longer one."""
        in_memory = self.cache.longest(ids)
        if self.store is not None:
            seq, _ = await self.store.take(ids, have=in_memory)
            if seq is not None:
                return seq
        return self.cache.take(ids)[0]

    async def _generate(
        self,
        ids: list[int],
        opts: RequestOptions,
        seq: SequenceHandle | None,
        prepared: Callable[[SequenceHandle, int], None],
        fmt: Format,
        response: web.StreamResponse | None,
    ) -> None:
        """Feed the engine's events for ``ids`` (on ``seq``, a new sequence if None) into
        ``fmt.out`` until they end or a stop string does; each piece of text and each tool
        call goes to the client as events at once if ``response`` streams. A client that
        disconnects cancels this with its handler (aiohttp's handler cancellation)."""
        out = fmt.out
        events = self.engine.stream(
            ids,
            opts.params,
            opts.max_tokens,
            sequence=seq,
            stop_at_eos=opts.stop_at_eos,
            on_prepared=prepared,
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

    def _reply(
        self,
        turn: Turn,
        ids: list[int],
        seq: SequenceHandle,
        generated: list[int],
        text: str,
        ended: bool,
        cut: bool,
    ) -> ChatReply | None:
        """What the prefix cache keeps of a chat request's reply (``PrefixCache.follow_up``
        continues from it), or None where the ``text`` the client was given is not exactly
        the text of ids in the stream: then a follow-up templates the messages whole.
        ``generated``: the ids shown; ``ended``: the model's end-of-turn id follows them;
        ``cut``: a stop string ended the text (the ids past it are not the reply)."""
        tok = self.engine.tokenizer
        eos = set(getattr(tok, "eos_token_ids", None) or [])
        if any(t in eos for t in generated):  # ignore_eos: an end of turn inside the reply
            return None
        n = reply_ids(tok, generated, text, cut)
        if n is None:
            return None
        ended = ended and not cut
        start, end = len(ids), len(ids) + n + ended
        tokens = seq.tokens  # a cancelled request's last step may still append: read once
        if len(tokens) < end or tokens[:start] != ids or tokens[start : start + n] != generated[:n]:
            return None
        if ended and tokens[end - 1] not in eos:
            return None
        return ChatReply(turn.messages, text, end)


def _route_exists(request: web.Request) -> bool:
    """Whether the request's path is one of ours (its method aside)."""
    refusal = request.match_info.http_exception
    return refusal is None or refusal.status == 405


def _line(e: object) -> str:
    """An exception's message on one line, at most 200 characters."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def bind_failure(host: str, port: int, error: OSError) -> str:
    """One line for a host and port the server cannot listen on, naming the fix."""
    if error.errno == errno.EADDRINUSE:
        return (
            f"port {port} on {host} is in use (another server?); give another --port (0: any free)"
        )
    if error.errno == errno.EACCES:
        return f"port {port} on {host} needs privileges; give a --port of 1024 or more"
    reason = error.strerror or error
    return f"cannot listen on {host}:{port} ({reason}); check --host and --port"


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
    in progress). ``server``: a Server made by the caller (benchmarks inspect it).
    Raises SmoeError (one line naming the fix) if ``host``/``port`` cannot be bound; a request's failure never escapes
    (it becomes that request's 4xx or 5xx, see the module doc)."""
    server = server or Server(engine, options)
    if options.guard is None:
        server.guard = Guard.for_bind(host)
    if options.prewarm_when_idle:

        def prewarm() -> None:
            engine.prewarm()

        engine.batcher.on_idle = prewarm
    runner = web.AppRunner(
        server.app,
        handler_cancellation=True,
        access_log=None,
        logger=http_log,
        shutdown_timeout=options.shutdown_s,
        keepalive_timeout=options.idle_timeout_s,  # idle sockets, before and between requests
        read_bufsize=READ_BUFSIZE,  # what a connection's unread body may hold (intake.py)
    )
    if server.store is not None:
        await server.store.open()  # (SmoeError: a directory it cannot make or list)
    await runner.setup()
    try:
        listening, _ = await listen(runner, host, port, options.max_connections)
    except OSError as e:
        await runner.cleanup()
        raise SmoeError(bind_failure(host, port, e)) from e
    # What is loaded by now (the engine, the model's code) lives as long as the server: out
    # of the cyclic collector's way, so a full collection walks only what requests made
    # (a walk of the whole heap held the interpreter lock, and /health, for up to 0.7 s).
    if not gc.get_freeze_count():  # (a process's first server: its garbage dropped first)
        gc.collect()
    gc.freeze()
    if options.prewarm_when_idle:
        engine.prewarm()  # idle from the start
    if ready is not None:
        sockets = listening.sockets
        ready(sockets[0].getsockname()[1] if sockets else port)
    try:
        await anyio.sleep_forever()
    finally:
        # Stopping (a signal cancels us): take no new connection, end every generation in
        # flight after the step in progress (each stream sends its error event and ends),
        # then give the handlers up to shutdown_s to finish writing.
        with anyio.CancelScope(shield=True):
            listening.close()
            if options.end_requests_on_stop:
                await engine.end_requests(
                    ShuttingDown("the server is shutting down; retry on its next start")
                )
            await runner.cleanup()
            if server.store is not None:
                await server.store.aclose()  # writes under way end whole
