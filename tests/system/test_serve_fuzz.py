"""HTTP fuzz of `smoe serve`: hundreds of malformed requests, seeded, over loopback.

A real server (``serve`` on 127.0.0.1, an ephemeral port, a tiny vault) gets each request
on a fresh raw socket (``Connection: close``, read to EOF), so broken HTTP reaches it as
sent. Classes: non-finite and huge numbers, wrong types, deep nesting, bad Unicode,
truncated JSON, wrong methods and paths, huge headers, wrong content types, broken
framing, and random mutations of valid bodies. Afterwards: no 5xx, no hang, no
traceback in the log, the same greedy reply as before, and the server process's RSS and
open file descriptors within 5% of where they stood after a warm-up round.

``SMOE_FUZZ_REPORT=PATH`` writes the per-class figures as JSON (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from smoe.engine import Engine
from smoe.serve.app import ServerOptions, serve
from smoe.serve.validate import FIELDS
from tests.conftest import tiny_vault

pytestmark = pytest.mark.asyncio

MAX_BODY = 256 * 1024  # the fuzzed server's limit: "too large" bodies stay cheap to send
BODY_TIMEOUT = 0.5  # s; a stalled body gets 408 this soon
CONTEXT = 40  # tokens: a mutated request that happens to be valid generates 7 or fewer


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    return tiny_vault(root, seed=11)


# ----------------------------------------------------------------- requests


@dataclass
class Case:
    kind: str  # the fuzz class
    data: bytes  # what goes on the wire
    half_close: bool = False  # shut our side after sending (a body that never completes)


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
VALID_CHAT: dict[str, Any] = {
    "model": "smoe",
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "max_tokens": 2,
    "temperature": 0,
}
VALID_COMPLETION: dict[str, Any] = {"model": "smoe", "prompt": list(range(5, 38)), "max_tokens": 2}


def http(
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    length: int | None = None,
) -> bytes:
    """One HTTP/1.1 request; ``length`` overrides Content-Length (-1: none)."""
    head = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    given = {"Content-Type": "application/json"} if headers is None else headers
    head += [f"{k}: {v}" for k, v in given.items()]
    if length != -1:
        head.append(f"Content-Length: {len(body) if length is None else length}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body


def post(body: dict[str, Any] | bytes | str, path: str = CHAT, **kw: Any) -> bytes:
    if isinstance(body, dict):
        body = json.dumps(body)
    if isinstance(body, str):
        body = body.encode("utf-8", "surrogatepass")
    return http("POST", path, body, **kw)


def with_field(name: str, literal: str) -> tuple[bytes, str]:
    """A valid body for the field's endpoint with ``"name": literal`` (raw JSON text)."""
    path = COMPLETIONS if FIELDS.get(name) and FIELDS[name].only == "completions" else CHAT
    base = dict(VALID_COMPLETION if path == COMPLETIONS else VALID_CHAT)
    base.pop(name, None)
    text = json.dumps(base)
    return f'{text[:-1]}, "{name}": {literal}}}'.encode("utf-8", "surrogatepass"), path


NUMERIC = [
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "min_p",
    "repetition_penalty",
    "max_tokens",
    "max_completion_tokens",
    "seed",
    "top_k",
    "n",
]
POOL: list[Any] = [
    None,
    True,
    False,
    0,
    1,
    -1,
    3,
    0.5,
    -0.5,
    1e308,
    -1e308,
    5e-324,
    2**31,
    2**53 + 1,
    2**63,
    2**64,
    -(10**19),
    10**30,
    "",
    "x",
    "\x00",
    "é中😀",
    "a" * 3000,
    [],
    [1],
    ["a"],
    [[1]],
    [None],
    {},
    {"type": "text"},
    {"role": "user", "content": "x"},
    {"a": {"b": [1, {"c": None}]}},
]


def nested(depth: int, opener: str) -> str:
    if opener == "[":
        return "[" * depth + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


def fixed_cases(rng: random.Random) -> Iterator[Case]:
    for name in NUMERIC:  # NaN, Infinity and floats beyond 64 bits
        for literal in ("NaN", "Infinity", "-Infinity", "1e400", "-1e999"):
            yield Case("non-finite numbers", post(*with_field(name, literal)))
    for name in NUMERIC:  # integers beyond 64 bits, and beyond Python's digit limit
        for value in (10**19, 2**64, -(10**19), 2**63, 10**400):
            yield Case("huge integers", post(*with_field(name, str(value))))
    yield Case("huge integers", post(*with_field("temperature", "9" * 5000)))
    for name in [*FIELDS, "model"]:  # each field with values of every other JSON type
        for value in (True, "1", [], {}, 1.5, -1, [1], {"a": 1}, "é"):
            yield Case("wrong types", post(*with_field(name, json.dumps(value))))
    for depth in (65, 200, 1000, 10_000, 100_000):
        for opener in "[{":
            deep = nested(depth, opener)
            yield Case("deep nesting", post(deep))
            yield Case("deep nesting", post(*with_field("metadata", deep)))
            yield Case("deep nesting", post(*with_field("stop", deep)))
    for escape in ("\\ud800", "\\udfff", "\\udc00\\ud800", "a\\ud83d", "\\ud83d x"):
        for where in ("content", "prompt", "stop", "model", "key"):
            if where == "content":
                body = json.dumps(VALID_CHAT).replace('"Hi"', f'"{escape}"')
                yield Case("bad unicode", post(body))
            elif where == "prompt":
                yield Case("bad unicode", post(*with_field("prompt", f'"{escape}"')))
            elif where == "key":
                yield Case("bad unicode", post(json.dumps(VALID_CHAT)[:-1] + f', "{escape}": 1}}'))
            else:
                yield Case("bad unicode", post(*with_field(where, f'"{escape}"')))
    for raw in (b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x82", b"\xf4\x90\x80\x80", b"\x80"):
        body = json.dumps(VALID_CHAT).encode().replace(b'"Hi"', b'"' + raw + b'"')
        yield Case("bad unicode", post(body))
    for _ in range(40):
        text = json.dumps(rng.choice([VALID_CHAT, VALID_COMPLETION]))
        yield Case("truncated JSON", post(text[: rng.randrange(len(text))]))
    for method in ("GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "FOO", "G\x00T"):
        for path in (CHAT, COMPLETIONS, "/v1/models", "/health", "/nope", "/%ff", "*", "/.."):
            yield Case("wrong methods and paths", http(method, path, b"{}"))
    for headers in (
        {"X-Big": "a" * 9000},
        {"X-Big": "a" * 70_000},
        {f"X-{i}": "v" for i in range(150)},
        {f"X-{i}": "v" * 100 for i in range(1000)},
        {"Content-Type": "application/json", "X-Bytes": "\udcff\udcfe"},
        {"Content-Type": "application/json", "Bad Name": "v"},
        {"Content-Type": "application/json", "Authorization": "Bearer " + "k" * 8000},
    ):
        yield Case("huge headers", post(VALID_CHAT, headers=headers))
    yield Case(
        "huge headers", http("POST", CHAT + "?" + "q" * 20_000, json.dumps(VALID_CHAT).encode())
    )
    for ctype in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/json; charset=bogus",
        "application/json; charset=latin-1",
        "application/json; charset=utf-16",
        "application/json; charset=",
        "application/json;;;charset",
        ";",
        "*/*",
        "application/json; charset=\udcff",
        "\udcff\udcfe/json",
    ):
        yield Case("content types", post(VALID_CHAT, headers={"Content-Type": ctype}))
    body = json.dumps(VALID_CHAT).encode()
    for raw in (b"", b"null", b"[]", b"1", b'"s"', b"true", b" ", b"{}", b"{" + b" " * 1000):
        yield Case("body framing", post(raw))
    yield Case("body framing", post(b"{" + b'"a":1,' * (MAX_BODY // 5) + b'"b":2}'))  # over
    yield Case("body framing", http("POST", CHAT, body, length=len(body) + 50), half_close=True)
    yield Case("body framing", http("POST", CHAT, body, length=len(body) + 50))  # stalls: 408
    yield Case("body framing", http("POST", CHAT, body, length=-1))  # no length: empty body
    chunked = {"Content-Type": "application/json", "Transfer-Encoding": "chunked"}
    chunk = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    yield Case("body framing", http("POST", CHAT, chunk, chunked, length=-1))  # valid
    yield Case("body framing", http("POST", CHAT, b"zz\r\nab\r\n0\r\n\r\n", chunked, length=-1))
    yield Case("body framing", http("POST", CHAT, chunk[:20], chunked, length=-1), half_close=True)
    yield Case("body framing", http("POST", CHAT, chunk, chunked))  # both lengths


def mutated(rng: random.Random) -> bytes:
    """A valid body after one to three random mutations."""
    path = rng.choice([CHAT, COMPLETIONS])
    body: Any = json.loads(json.dumps(VALID_CHAT if path == CHAT else VALID_COMPLETION))
    for _ in range(rng.randint(1, 3)):
        if not isinstance(body, dict):
            break
        op = rng.randrange(6)
        if op == 0:  # a known field, a random value
            body[rng.choice([*FIELDS, *NUMERIC])] = rng.choice(POOL)
        elif op == 1 and body:  # a field gone
            body.pop(rng.choice(list(body)))
        elif op == 2:  # an unknown field
            body[rng.choice(["foo", "", "é", "messages ", "MAX_TOKENS"])] = rng.choice(POOL)
        elif op == 3 and path == CHAT:  # a message broken
            messages = body.get("messages")
            if isinstance(messages, list) and messages:
                i = rng.randrange(len(messages))
                old = messages[i]
                if isinstance(old, dict) and rng.random() < 0.7:
                    key = rng.choice(["role", "content", "name"])
                    messages[i] = {**old, key: rng.choice(POOL)}
                else:
                    messages[i] = rng.choice(POOL)
        elif op == 4 and path == COMPLETIONS:  # a prompt broken
            body["prompt"] = rng.choice(
                [[rng.choice(POOL)], [5, rng.choice(POOL)], rng.choice(POOL)]
            )
        else:  # the whole body replaced by a pool value
            body = rng.choice(POOL) if rng.random() < 0.1 else body
    text = json.dumps(body).encode()
    if rng.random() < 0.2 and text:  # a byte flipped
        i = rng.randrange(len(text))
        text = text[:i] + bytes([rng.randrange(256)]) + text[i + 1 :]
    return post(text, path)


def corpus(seed: int, mutations: int) -> list[Case]:
    rng = random.Random(seed)
    cases = list(fixed_cases(rng))
    cases += [Case("random mutations", mutated(rng)) for _ in range(mutations)]
    return cases


# ----------------------------------------------------------------- the client


async def send(port: int, case: Case) -> int | None:
    """The response's status, or None when the server closed without one (a request the
    client broke off). Raises TimeoutError when the server neither answers nor closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(case.data)
        if case.half_close:
            writer.write_eof()
        async with asyncio.timeout(10):
            raw = await reader.read()  # to EOF: the server has closed its socket by then
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    if not raw:
        return None
    return int(raw.split(b" ", 2)[1])


def rss_kb() -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def greedy(port: int) -> bytes:
    """A valid request's reply with the parts that vary (ids, times, the prompt tokens
    found in the prefix cache) cut out."""
    body = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(post(body, COMPLETIONS))
    raw = await reader.read()
    writer.close()
    await writer.wait_closed()
    reply = json.loads(raw.split(b"\r\n\r\n", 1)[1])
    reply["usage"].pop("prompt_tokens_details")
    return json.dumps([reply["choices"], reply["usage"]]).encode()


# ----------------------------------------------------------------- the test


async def test_fuzzed_requests_get_clean_errors_and_leave_nothing_behind(vault, caplog):
    caplog.set_level(logging.WARNING)
    options = ServerOptions(max_body_bytes=MAX_BODY, body_timeout_s=BODY_TIMEOUT)
    async with Engine.open(vault.path, max_context=CONTEXT) as engine:
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        server = loop.create_task(serve(engine, "127.0.0.1", 0, options, ready=ready.set_result))
        port = await ready
        try:
            before = await greedy(port)
            for case in corpus(seed=1, mutations=100):  # warm-up: caches, pools, templates
                await send(port, case)
            await greedy(port)
            rss0, fds0 = rss_kb(), open_fds()
            stats: dict[str, Counter[str]] = defaultdict(Counter)
            for case in corpus(seed=2, mutations=200):
                try:
                    status = await send(port, case)
                except TimeoutError:
                    status = "hang"
                stats[case.kind][str(status)] += 1
            after = await greedy(port)
            rss1, fds1 = rss_kb(), open_fds()
            assert not server.done()  # still serving
        finally:
            server.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await server
    report(stats, rss0, rss1, fds0, fds1)
    total = Counter[str]()
    for counts in stats.values():
        total.update(counts)
    assert sum(total.values()) >= 700
    bad = {k: c for k, c in stats.items() if any(s == "hang" or s[0] == "5" for s in c)}
    assert not bad, bad  # no 5xx, no hang
    no_answer = {kind: c["None"] for kind, c in stats.items() if c["None"]}
    assert no_answer == {"body framing": 2}  # only the two bodies we broke off
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not logged, [r.getMessage() for r in logged]  # no traceback, no error logged
    assert after == before  # the same greedy tokens as before the fuzz
    assert rss1 <= rss0 * 1.05, (rss0, rss1)
    assert fds1 <= fds0 * 1.05, (fds0, fds1)


def report(stats: dict[str, Counter[str]], rss0: int, rss1: int, fds0: int, fds1: int) -> None:
    path = os.environ.get("SMOE_FUZZ_REPORT")
    if path:
        Path(path).write_text(
            json.dumps(
                {
                    "classes": {k: dict(v) for k, v in stats.items()},
                    "rss_kb": [rss0, rss1],
                    "fds": [fds0, fds1],
                },
                indent=1,
            )
        )
