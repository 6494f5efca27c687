"""The listening socket, with a cap on open connections: past ``max_connections`` a new
connection gets a 503 (a JSON body naming the reason) and is closed at once, so a flood of
idle sockets cannot take the server down; the connections already open are served as
before. Idle connections (none sent yet, or between requests) are closed by aiohttp's
keep-alive timer (``keepalive_timeout``, set from ``ServerOptions.idle_timeout_s``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

from aiohttp import web


def base_urls(base: str) -> str:
    """Each API's base URL at ``base`` as its Python client takes it (``OpenAI(base_url=)``
    appends /chat/completions, ``Anthropic(base_url=)`` /v1/messages, ``ollama.Client(host=)``
    /api/chat): what `smoe serve`'s start line names."""
    return f"base URLs: OpenAI {base}/v1, Anthropic {base}, Ollama {base}"


BUSY_BODY = json.dumps(
    {
        "error": {
            "message": "the server has too many open connections; retry later",
            "type": "server_error",
            "param": None,
            "code": "too_many_connections",
        }
    }
).encode()
BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nRetry-After: 1\r\nContent-Length: "
    + str(len(BUSY_BODY)).encode()
    + b"\r\n\r\n"
    + BUSY_BODY
)


class _Busy(asyncio.Protocol):
    """A connection past the cap: the 503, then the close."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tcp = cast(asyncio.Transport, transport)  # (uvloop's is not asyncio's class)
        tcp.write(BUSY)
        tcp.close()


class CappedFactory:
    """aiohttp's protocol factory (``runner.server``), or ``_Busy`` past the cap."""

    def __init__(self, server: web.Server, max_connections: int) -> None:
        self.server = server
        self.max_connections = max_connections
        self.refused = 0  # connections turned away (the server's /metrics could count them)

    def __call__(self) -> Any:
        if len(self.server.connections) >= self.max_connections:
            self.refused += 1
            return _Busy()
        return self.server()


async def listen(
    runner: web.AppRunner, host: str, port: int, max_connections: int
) -> tuple[asyncio.Server, CappedFactory]:
    """Listen on ``host``:``port`` for ``runner`` (set up); OSError if it cannot bind."""
    assert runner.server is not None, "runner.setup() first"
    factory = CappedFactory(runner.server, max_connections)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(factory, host, port, reuse_address=True, backlog=128)
    return server, factory
