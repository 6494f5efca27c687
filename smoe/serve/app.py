"""`smoe serve`: an OpenAI-, Anthropic- and Ollama-compatible HTTP server (aiohttp on
uvloop) over one Engine.

Endpoints: POST /v1/chat/completions (JSON or server-sent events), POST /v1/completions,
GET /v1/models, GET /health, GET /v1/smoe/stats; Anthropic's POST /v1/messages
(smoe/serve/anthropic_api.py) and Ollama's /api/chat, /api/generate, /api/tags
(smoe/serve/ollama_api.py). Every API goes through one pipeline: its request checked into
the same fields, the prompt's ids (the chat template, with tools: smoe/serve/prompt.py),
``Pipeline.answer`` (the engine's events into a ``Completion``: smoe/serve/pipeline.py),
and the API's ``Format`` for the body or the stream's events.
Errors take the shape of the route's API: a 4xx naming the field for a bad request
(smoe/serve/body.py checks the body, validate.py every field), 503 when the engine cannot
serve (its vault or disk failing), 500 only for a bug of ours; a 5xx tells the client a
request id, never internals, and the server log has the details (smoe/serve/api_error.py,
middleware.py).

This module puts the server together: the dialects know it only as a ``ServeContext``
(smoe/serve/context.py), each dialect module a ``Dialect`` (its routes, its error shape).

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

import errno
import gc
import logging
from typing import Any

import anyio
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from smoe.engine import Engine
from smoe.engine.prefix_store import PrefixStore
from smoe.errors import ShuttingDown, SmoeError
from smoe.serve import anthropic_api, ollama_api, openai_api, server_routes
from smoe.serve.api_error import ApiError
from smoe.serve.context import Dialect, ServeContext
from smoe.serve.counters import ServerCounts
from smoe.serve.guard import Guard
from smoe.serve.health import Health
from smoe.serve.intake import READ_BUFSIZE
from smoe.serve.listener import listen
from smoe.serve.middleware import Middleware
from smoe.serve.options import ServerOptions
from smoe.serve.pipeline import Pipeline
from smoe.serve.prefix import PrefixCache
from smoe.serve.prompt import Intake

__all__ = ["Server", "ServerOptions", "bind_failure", "serve"]

DIALECTS: tuple[Dialect, ...] = (openai_api, anthropic_api, ollama_api)


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
http_log.addFilter(_MalformedHttp())


def error_json(path: str, e: ApiError) -> dict[str, Any]:
    """``e`` in the error shape of the API that ``path`` belongs to: the dialect whose
    ``PATH_PREFIX`` is the longest that ``path`` begins with (OpenAI's: "/")."""
    owner = max(
        (d for d in DIALECTS if path.startswith(d.PATH_PREFIX)),
        key=lambda d: len(d.PATH_PREFIX),
        default=openai_api,
    )
    return owner.error_json(e)


def error_response(path: str, e: ApiError) -> web.Response:
    """``e`` as the response of the API that ``path`` belongs to."""
    return web.json_response(error_json(path, e), status=e.status)


class Server:
    """The HTTP front of one engine: its aiohttp ``app`` with every API's routes, and
    what it keeps while serving (the prefix cache, the counts). Made on the event loop;
    ``serve`` runs it."""

    def __init__(self, engine: Engine, options: ServerOptions) -> None:
        self.engine = engine
        self.options = options
        self.counts = ServerCounts()
        # Why the last request that failed for the server's sake failed (a 503), until a
        # request succeeds again: /health reports it.
        self.health = Health()
        self.pipeline = Pipeline(engine, options, self.counts, self.health)
        # Requests into prompts, within the request memory (smoe/serve/prompt.py)
        self.intake = Intake(
            engine,
            self.pipeline.cache,
            max_queue=options.max_queue,
            max_body_bytes=options.max_body_bytes,
            body_timeout_s=options.body_timeout_s,
            request_memory=options.request_memory,
        )
        # Who may talk to us; serve() sets it from the bind address unless options say.
        self.middleware = Middleware(
            options.guard or Guard(loopback_only=False),
            options.api_key,
            options.max_body_bytes,
            self.counts,
            self.health,
            error_response,
        )
        self.app = web.Application(
            middlewares=self.middleware.chain(), client_max_size=options.max_body_bytes
        )
        self.app.on_response_prepare.append(self.middleware.cors_headers)
        ctx = ServeContext(engine, options, self.intake, self.pipeline)
        self.app.add_routes(
            [*server_routes.routes(ctx), *(route for d in DIALECTS for route in d.routes(ctx))]
        )

    @property
    def guard(self) -> Guard:
        """Who may talk to the server (smoe/serve/guard.py); settable until it serves."""
        return self.middleware.guard

    @guard.setter
    def guard(self, guard: Guard) -> None:
        self.middleware.guard = guard

    @property
    def cache(self) -> PrefixCache:
        return self.pipeline.cache

    @property
    def store(self) -> PrefixStore | None:
        return self.pipeline.store

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens whose keys and values were reused."""
        return self.counts.reused_tokens

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens run (all but each prompt's last)."""
        return self.counts.prefilled_tokens

    @property
    def reply_follow_ups(self) -> int:
        """Chat requests that continued a cached reply's ids."""
        return self.counts.reply_follow_ups


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
        engine.learning.when_idle(engine.learning.prewarm)
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
        engine.learning.prewarm()  # idle from the start
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
