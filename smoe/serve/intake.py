"""What a request may hold before it joins the queue, bounded so that no number of clients
takes `smoe serve` past ``--memory``: its body's bytes as they arrive, and the memory its
preparation takes (parsing, checking, templating, tokenizing). Sizes are bytes.

- **Connections.** aiohttp keeps at most twice ``READ_BUFSIZE`` of a body that no one
  reads, plus the transport's last read, before it stops reading the socket; a body up to
  ``SMALL_BODY`` is read whole. ``CONNECTION_BYTES`` covers both (measured: 160 kB a
  stalled connection at this buffer size; docs/serve.md), so ``max_connections`` of them
  is a fixed part of the plan.
- **Large bodies** take their bytes from ``RequestMemory.receiving`` (half of
  ``--request-memory``) as they arrive, never waiting: when it is full the request gets
  503 at once, so clients that stall large bodies hold at most that half, and never
  delay a small body.
- **Preparation** runs on a worker thread, one request at a time per lane (one for small
  bodies, one for large), so its memory is one request's: its parse (``parse_bytes``,
  from the body's size and how many JSON values it holds, counted without parsing) and
  its tokenizing (``TOKENIZE_BYTES`` per byte of text) must each fit
  ``RequestMemory.preparing`` (the other half), else 413 naming ``--request-memory``.
  A text longer than the context can hold in tokens (``Limits.text_bytes``, from the
  vocabulary's longest token) is refused before any tokenizing.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from aiohttp import web

from smoe.serve.api_error import ApiError

READ_BUFSIZE = 16 * 1024  # aiohttp pauses a socket whose unread body passes twice this
SMALL_BODY = 64 * 1024  # bodies up to this are read within the connection's own allowance
CONNECTION_BYTES = 256 * 1024  # aiohttp's buffers (measured 160 kB) + a small body
REQUEST_MEMORY = 64 * 1024**2  # --request-memory's default
MIN_REQUEST_MEMORY = 8 * 1024**2  # a 4 MiB body arriving, and a preparation of 4 MiB
# A parsed JSON value costs at most this beside its text (an empty object: 64 bytes and
# a list slot; measured 70 bytes a value for '[{},{},...]', 36 for integer ids).
VALUE_BYTES = 96
# Tokenizing holds this much per byte of text (the tokenizer's encoding and the id list;
# measured 89 for English prose, 25 for CJK, with the demo's tokenizer).
TOKENIZE_BYTES = 96
# The small lane's worst preparation: a SMALL_BODY parse and tokenizing its text
SMALL_LANE_BYTES = 4 * SMALL_BODY + VALUE_BYTES * SMALL_BODY // 2 + TOKENIZE_BYTES * SMALL_BODY

T = TypeVar("T")
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)  # as smoe/serve/body.py
_VALUE_MARKS = re.compile(rb"[,:\[{]")


def json_values(raw: bytes) -> int:
    """An upper bound on the JSON values in ``raw`` (valid or not) without parsing it:
    one, plus one per comma, colon and opening bracket outside strings."""
    return 1 + len(_VALUE_MARKS.findall(_STRING.sub(b'""', raw)))


def parse_bytes(raw: bytes) -> int:
    """What parsing ``raw`` may hold at once: the bytes, their text and every value."""
    return 4 * len(raw) + VALUE_BYTES * json_values(raw)


def serve_reserve(max_connections: int, request_memory: int) -> int:
    """The bytes `smoe serve` keeps beside the engine for its clients (the plan counts
    them in working memory): every connection's allowance, the request memory and the
    small lane's preparation."""
    return max_connections * CONNECTION_BYTES + request_memory + SMALL_LANE_BYTES


class BytePool:
    """A count of bytes that requests take and give back (event loop only)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0

    def try_take(self, n: int) -> bool:
        """Take ``n`` bytes if they are free; never waits."""
        if self.held + n > self.capacity:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        if not 0 <= n <= self.held:
            raise RuntimeError(f"gave back {n} bytes while {self.held} are held")
        self.held -= n


class RequestMemory:
    """``--request-memory``: half for large bodies arriving (``receiving``), half the most
    one preparation may hold (``preparing``); and the two preparation lanes."""

    def __init__(self, total: int = REQUEST_MEMORY) -> None:
        self.receiving = BytePool(total // 2)
        self.preparing = total - total // 2
        self.small_lane = anyio.CapacityLimiter(1)
        self.large_lane = anyio.CapacityLimiter(1)
        self.refused = 0  # large bodies turned away while the receiving half was full

    def check_parse(self, raw: bytes) -> None:
        """413 if parsing ``raw`` may take more than one preparation may hold."""
        need = parse_bytes(raw)
        if need > self.preparing:
            raise _too_large(f"parsing it would take about {need // 2**20} MiB", self.preparing)

    def check_tokenize(self, text_bytes: int) -> None:
        """413 if tokenizing ``text_bytes`` of text may take more than one preparation may."""
        need = TOKENIZE_BYTES * text_bytes
        if need > self.preparing:
            raise _too_large(
                f"tokenizing its {text_bytes} bytes of text would take about {need // 2**20} MiB",
                self.preparing,
            )


def _too_large(why: str, limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request is too large for this server: {why}, more than the "
        f"{limit // 2**20} MiB one request may use; send less, or start the server with a "
        "larger --request-memory",
        code="request_too_large",
    )


class Body:
    """A request body read within the request memory; ``release`` gives its bytes back
    (idempotent, event loop only)."""

    def __init__(self, raw: bytes, pool: BytePool, charged: int) -> None:
        self.raw = raw
        self._pool, self._charged = pool, charged

    @property
    def small(self) -> bool:
        return len(self.raw) <= SMALL_BODY

    def release(self) -> None:
        charged, self._charged = self._charged, 0
        if charged:
            self._pool.give(charged)


async def read_body(
    request: web.Request, memory: RequestMemory, max_bytes: int, timeout_s: float
) -> Body:
    """The request's body, read within ``memory`` (module doc). ApiError 413 past
    ``max_bytes`` (before reading, when Content-Length says so), 503 when the receiving
    half is full, 408 when it does not arrive within ``timeout_s``. Cancellation (the
    client gone) passes through; whatever it charged is given back."""
    length = request.content_length
    if length is not None and length > max_bytes:
        raise body_too_large(max_bytes)
    pool = memory.receiving
    charged = 0
    data = bytearray()

    def charge(upto: int) -> None:
        nonlocal charged
        if upto <= charged:
            return
        if not pool.try_take(upto - charged):
            memory.refused += 1
            raise ApiError(
                503,
                "the server is receiving too many large request bodies at once; retry shortly",
                "server_error",
                code="server_busy",
            )
        charged = upto

    try:
        if length is not None and length > SMALL_BODY:
            charge(length)  # all at once: refused before a byte is read
        with anyio.fail_after(timeout_s):
            async for chunk in request.content.iter_any():
                if len(data) + len(chunk) > max_bytes:
                    raise body_too_large(max_bytes)
                if length is None and len(data) + len(chunk) > SMALL_BODY:  # charged ahead
                    charge(max(charged, min(max_bytes, 2 * (len(data) + len(chunk)))))
                data += chunk
    except TimeoutError:
        pool.give(charged)
        raise ApiError(
            408,
            f"the request body did not arrive within {timeout_s:g} s",
            code="request_timeout",
        ) from None
    except BaseException:
        pool.give(charged)
        raise
    return Body(bytes(data), pool, charged)


def body_too_large(max_bytes: int) -> ApiError:
    return ApiError(
        413,
        f"the request body exceeds this server's limit of {max_bytes} bytes",
        code="request_too_large",
    )


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a worker thread (anyio's thread crossing): the event loop keeps
    answering meanwhile. Not abandoned on cancellation: it returns first."""
    return await anyio.to_thread.run_sync(fn, *args)
