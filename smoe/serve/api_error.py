"""The errors `smoe serve` answers with, in OpenAI's shape.

``ApiError`` is one HTTP error (a 4xx naming the field, or a 5xx); ``failure`` is what a
failure that is not the client's becomes (503 or 500: a request id, never internals, the
details in the server log); ``http_error`` puts aiohttp's own refusals (no route, wrong
method, body too large) in the same shape.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from smoe.errors import ShuttingDown, SmoeError

log = logging.getLogger("smoe.serve")


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

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

    def to_json(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        return web.json_response(self.to_json(), status=self.status)


def failure(e: Exception, rid: str) -> ApiError:
    """What the client is told about a failure that is not its request's fault. A
    SmoeError or OSError (the vault or disk failing, the engine closed) is the operator's
    to fix: 503, one log line. Anything else is a bug of ours: 500, the traceback logged
    once. Neither tells the client more than the class and a request id to quote."""
    if isinstance(e, ShuttingDown):  # our own words, meant for the client
        log.info("request %s: %s", rid, e)
        return ApiError(503, str(e), "server_error", code="shutting_down")
    if isinstance(e, (SmoeError, OSError)):
        log.error("request %s: %s: %s", rid, type(e).__name__, " ".join(str(e).split()))
        return ApiError(
            503,
            f"the server cannot serve requests right now ({type(e).__name__}); retry "
            f"later, or give its operator the request id {rid}",
            "server_error",
            code="service_unavailable",
        )
    log.error("request %s failed", rid, exc_info=e)
    return ApiError(
        500,
        f"internal server error; give the server's operator the request id {rid}",
        "server_error",
        code="internal_error",
    )


def http_error(request: web.Request, e: web.HTTPException, max_body: int) -> ApiError:
    """aiohttp's own refusals (no route, wrong method, body too large) in OpenAI's shape."""
    what = f"{request.method} {request.path}"
    if e.status == 404:
        return ApiError(404, f"no such endpoint: {what}", code="not_found")
    if e.status == 405:
        allowed = getattr(e, "allowed_methods", None) or ()
        return ApiError(
            405,
            f"{what} is not allowed; use {' or '.join(sorted(allowed)) or 'another method'}",
            code="method_not_allowed",
        )
    if e.status == 413:
        return ApiError(
            413,
            f"the request body exceeds this server's limit of {max_body} bytes",
            code="request_too_large",
        )
    return ApiError(e.status, e.reason or "error")
