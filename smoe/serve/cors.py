"""Cross-origin requests from web pages the server lets in (smoe/serve/guard.py decides
which: a loopback page on a loopback server, the request's own host, or ``--allow-origin``).

A browser reads a cross-origin answer only when it carries ``Access-Control-Allow-Origin``,
and it asks first (a preflight: OPTIONS with ``Access-Control-Request-Method``) before a
POST with a JSON body or an ``Authorization`` header. So: every answer to an origin the
guard admits names that origin (never ``*``: the key may be sent), and a preflight from it
gets 204 with the methods and headers it asked for. A preflight needs no key (browsers
never send one with it); the request that follows still does. An origin the guard refuses
gets its 403, preflight or not.
"""

from __future__ import annotations

import re

from aiohttp import web

from smoe.serve.guard import Guard

METHODS = "GET, POST, OPTIONS"
# What the APIs' browser clients send beside the defaults browsers allow
ALLOWED_HEADERS = "Authorization, Content-Type, X-Api-Key, Anthropic-Version, Anthropic-Beta"
EXPOSED_HEADERS = "X-Request-Id, Retry-After"
MAX_AGE_S = 600  # how long a browser may keep a preflight's answer
_HEADER_LIST = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+(\s*,\s*[A-Za-z0-9!#$%&'*+.^_`|~-]+)*$")


def admitted_origin(guard: Guard, request: web.BaseRequest) -> str | None:
    """The request's Origin when it sends one the guard lets in, else None."""
    origin = request.headers.get("Origin")
    if origin is None or guard.refusal(request.headers.get("Host"), origin) is not None:
        return None
    return origin


def is_preflight(request: web.BaseRequest) -> bool:
    return (
        request.method == "OPTIONS"
        and "Origin" in request.headers
        and "Access-Control-Request-Method" in request.headers
    )


def preflight(request: web.BaseRequest) -> web.Response:
    """204 for a preflight the guard admitted: the methods, and the headers it asked for
    (when they are a plain list of header names) or the APIs' own."""
    asked = request.headers.get("Access-Control-Request-Headers", "").strip()
    headers = {
        "Access-Control-Allow-Methods": METHODS,
        "Access-Control-Allow-Headers": asked if _HEADER_LIST.match(asked) else ALLOWED_HEADERS,
        "Access-Control-Max-Age": str(MAX_AGE_S),
    }
    return web.Response(status=204, headers=headers)


def add_headers(guard: Guard, request: web.BaseRequest, response: web.StreamResponse) -> None:
    """Name an admitted origin on ``response`` (aiohttp's on_response_prepare, so streams
    get it too, before their headers go)."""
    origin = admitted_origin(guard, request)
    vary = response.headers.get("Vary")
    response.headers["Vary"] = f"{vary}, Origin" if vary else "Origin"
    if origin is None:
        return
    response.headers["Access-Control-Allow-Origin"] = origin
    response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
