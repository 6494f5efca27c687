"""`smoe serve`'s middlewares, outermost first, and its CORS headers.

- ``access``: one log line per request (INFO on logger smoe.serve.access): method, path,
  status, seconds, generated tokens; never a key, a prompt or a reply. It counts the
  request by status for /metrics.
- ``errors``: every failure as an answer in the error shape of the route's API (a 4xx
  naming the field, 503 when the engine cannot serve, 500 only for a bug of ours), with
  the request's id (``X-Request-Id``); a client gone is a 499 in the access line.
- ``auth``: the Host and Origin rules, a browser's preflight, then the API key
  (smoe/serve/guard.py, cors.py).

Each request's handler runs in the task these run in, so it sees the request-scoped
values they set (smoe/serve/request_scope.py).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

from aiohttp import web
from aiohttp.typedefs import Handler
from aiohttp.typedefs import Middleware as AiohttpMiddleware

from smoe.serve import cors
from smoe.serve.api_error import ApiError, http_error
from smoe.serve.counters import ServerCounts
from smoe.serve.guard import Guard, key_matches, sent_key
from smoe.serve.health import Health
from smoe.serve.request_scope import DROPPED, GENERATED, REQUEST_ID

__all__ = ["ErrorResponse", "Middleware"]

access_log = logging.getLogger("smoe.serve.access")  # a line per request (``access``)

# ``e`` as the answer of the API that the path belongs to (its error shape)
ErrorResponse = Callable[[str, ApiError], web.Response]


class Middleware:
    """The server's middlewares (module doc) over its counts, health and access rules.
    ``guard`` may be replaced while serving (``serve`` sets the bind address's)."""

    def __init__(
        self,
        guard: Guard,
        api_key: str | None,
        max_body_bytes: int,
        counts: ServerCounts,
        health: Health,
        error_response: ErrorResponse,
    ) -> None:
        self.guard = guard
        self.api_key, self.max_body_bytes = api_key, max_body_bytes
        self.counts, self.health, self.error_response = counts, health, error_response

    def chain(self) -> list[AiohttpMiddleware]:
        """The middlewares in aiohttp's order (outermost first)."""
        return [self.access, self.errors, self.auth]

    @web.middleware
    async def access(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """One log line per request (module doc); counted by status, 499 for a client
        gone before an answer."""
        start = time.perf_counter()
        status = 499  # the client went away before an answer (nginx's code)
        generated: list[int] = []
        GENERATED.set(generated)  # the handler runs in this task: it appends to it
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
    async def errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The handler's answer, or its failure as an answer (module doc); never raises
        but for aiohttp's own redirects (a status below 400)."""
        rid = "req_" + uuid.uuid4().hex[:20]
        REQUEST_ID.set(rid)  # the handler runs in this task: it sees the id
        response: web.StreamResponse
        try:
            response = await handler(request)
        except ApiError as e:
            response = self.error_response(request.path, e)
            if e.status == 408:  # the body stalled: answer, then close at once (else
                # aiohttp waits up to 10 s more for the body before closing)
                response.headers["X-Request-Id"] = rid
                await response.prepare(request)
                await response.write_eof()
                request.protocol.force_close()
        except web.HTTPException as e:
            if e.status < 400:
                raise
            response = self.error_response(
                request.path, http_error(request, e, self.max_body_bytes)
            )
        except ConnectionError:  # the client has gone: nobody to answer (aiohttp's write
            # of this response fails quietly); the access line says 499
            request[DROPPED] = True
            response = web.Response(status=499)
        except Exception as e:  # not the request's fault: keep serving, tell no internals
            response = self.error_response(request.path, self.health.failure(e, rid))
        if not response.prepared:  # a stream has sent its headers already, with the id
            response.headers["X-Request-Id"] = rid
        return response

    @web.middleware
    async def auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """ApiError 403 for a Host or Origin the guard refuses, 401 for a missing or wrong
        key (/ and /health need none); a preflight is answered here."""
        refusal = self.guard.refusal(request.headers.get("Host"), request.headers.get("Origin"))
        if refusal is not None:
            raise ApiError(403, refusal, "permission_error", code="forbidden_origin")
        key = self.api_key
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

    async def cors_headers(self, request: web.BaseRequest, response: web.StreamResponse) -> None:
        """aiohttp's on_response_prepare: an admitted origin named on every answer."""
        cors.add_headers(self.guard, request, response)


def _route_exists(request: web.Request) -> bool:
    """Whether the request's path is one of ours (its method aside)."""
    refusal = request.match_info.http_exception
    return refusal is None or refusal.status == 405
