"""Who may talk to `smoe serve` (smoe/serve/guard.py): the Host and Origin rules as a
table, the API key's sources and its constant-time check, and the server refusing a
foreign web page, a rebound name and a wrong key; /health telling what the engine can do."""

from __future__ import annotations

import contextlib

import aiohttp
import pytest

from smoe.engine import Engine
from smoe.errors import SmoeError
from smoe.serve.app import ServerOptions
from smoe.serve.guard import API_KEY_ENV, Guard, host_name, key_matches, resolve_api_key
from tests.conftest import tiny_vault
from tests.fakes import FailingReads
from tests.serving import Running

LOOPBACK = Guard.for_bind("127.0.0.1")
PUBLIC = Guard.for_bind("0.0.0.0")


@pytest.mark.parametrize(
    ("guard", "host", "origin", "refused"),
    [
        (LOOPBACK, "127.0.0.1:8000", None, None),
        (LOOPBACK, "localhost:8000", None, None),
        (LOOPBACK, "[::1]:8000", None, None),
        (LOOPBACK, None, None, "--allow-host NAME"),  # HTTP/1.0 without Host
        (LOOPBACK, "evil.example:8000", None, "--allow-host evil.example"),  # DNS rebinding
        (Guard.for_bind("127.0.0.1", ["Box.LAN"]), "box.lan:8000", None, None),
        (LOOPBACK, "127.0.0.1:8000", "http://localhost:3000", None),
        (LOOPBACK, "127.0.0.1:8000", "http://127.0.0.1:8000", None),
        (LOOPBACK, "127.0.0.1:8000", "https://evil.example", "--allow-origin https://evil.example"),
        (LOOPBACK, "127.0.0.1:8000", "null", "--allow-origin null"),  # a sandboxed page
        (
            Guard.for_bind("::1", None, ["https://app.example/"]),
            "[::1]:1",
            "https://app.example",
            None,
        ),
        (Guard.for_bind("127.0.0.1", None, ["*"]), "127.0.0.1:1", "https://any.example", None),
        (PUBLIC, "box.lan:8000", None, None),  # any name on a public bind
        (PUBLIC, "box.lan:8000", "http://box.lan:8000", None),  # the page it serves itself
        (PUBLIC, "box.lan:8000", "https://evil.example", "--allow-origin"),
    ],
)
def test_host_and_origin_rules(guard, host, origin, refused):
    why = guard.refusal(host, origin)
    if refused is None:
        assert why is None
    else:
        assert why is not None and refused in why and "\n" not in why


def test_host_names_lose_port_and_brackets():
    assert host_name("[::1]:8000") == "::1" and host_name("LocalHost:80") == "localhost"
    assert host_name("::1") == "::1" and host_name("box") == "box"


def test_the_key_is_compared_whole():
    assert key_matches("s3cret", "s3cret")
    assert not key_matches("s3cret", "s3cre") and not key_matches("s3cret", "s3cretX")
    assert not key_matches("s3cret", "")


def test_the_key_comes_from_the_flag_then_the_file_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert resolve_api_key(None, None) is None
    monkeypatch.setenv(API_KEY_ENV, " from-env \n")
    assert resolve_api_key(None, None) == "from-env"
    f = tmp_path / "key"
    f.write_text("from-file\nignored\n")
    assert resolve_api_key(None, f) == "from-file"
    assert resolve_api_key("from-flag", f) == "from-flag"


@pytest.mark.parametrize("where", ["flag", "file", "env", "missing file", "binary file"])
def test_an_empty_or_unreadable_key_is_one_line_naming_its_source(where, tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    f = tmp_path / "key"
    f.write_text("  \n")
    args: tuple = {
        "flag": ("  ", None),
        "file": (None, f),
        "env": (None, None),
        "missing file": (None, tmp_path / "nope"),
        "binary file": (None, tmp_path / "bin"),
    }[where]
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00key")
    if where == "env":
        monkeypatch.setenv(API_KEY_ENV, "")
    with pytest.raises(SmoeError) as e:
        resolve_api_key(*args)
    message = str(e.value)
    assert "\n" not in message
    assert {"flag": "--api-key", "env": API_KEY_ENV}.get(where, "--api-key-file") in message


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    return tiny_vault(tmp_path_factory.mktemp("guard"), seed=5)


@pytest.mark.asyncio
async def test_the_server_refuses_a_foreign_page_a_rebound_name_and_a_wrong_key(vault):
    body = {"prompt": [5, 6, 7], "max_tokens": 2}
    async with (
        Engine.open(vault.path) as engine,
        Running(engine, ServerOptions(api_key="secret")) as srv,
        aiohttp.ClientSession() as http,
    ):
        url = srv.base + "/v1/completions"
        key = {"Authorization": "Bearer secret"}
        for headers in (
            {**key, "Origin": "https://evil.example"},
            {**key, "Host": "evil.example"},
        ):
            async with http.post(url, json=body, headers=headers) as r:
                assert r.status == 403
                err = (await r.json())["error"]
                assert err["code"] == "forbidden_origin" and "--allow-" in err["message"]
        for headers in ({"Authorization": "Bearer secre"}, {"x-api-key": "secretX"}, {}):
            async with http.post(url, json=body, headers=headers) as r:
                assert r.status == 401
        async with http.post(url, json=body, headers={"x-api-key": "secret"}) as r:
            assert r.status == 200  # Anthropic's header
        async with http.post(
            url, json=body, headers={**key, "Origin": f"http://localhost:{srv.port}"}
        ) as r:
            assert r.status == 200  # a page the user opened from this server's own name


@pytest.mark.asyncio
async def test_health_says_what_the_engine_can_do(vault):
    """Was {"status": "ok"} while every request got 503 (issue 30). No idle pre-warm: it
    could read every expert before the disk fails, and then no request would read."""
    body = {"prompt": [5, 6, 7], "max_tokens": 2}
    async with (
        Engine.open(vault.path) as engine,
        Running(engine, ServerOptions(prewarm_when_idle=False)) as srv,
        aiohttp.ClientSession() as http,
    ):
        async with http.get(srv.base + "/health") as r:
            got = await r.json()
            assert r.status == 200 and got["status"] == "ok" and got["max_batch"] >= 1
        disk = engine.debug.scheduler.wrap_backend(FailingReads)
        disk.failing = True
        for stream in (False, True):
            async with http.post(srv.base + "/v1/completions", json={**body, "stream": stream}):
                pass
            async with http.get(srv.base + "/health") as r:
                got = await r.json()
                assert r.status == 503 and got["status"] == "unavailable"
                assert "ExpertReadError" in got["why"] and "disk gone" not in got["why"]
        disk.failing = False
        async with http.post(srv.base + "/v1/completions", json=body) as r:
            assert r.status == 200
        async with http.get(srv.base + "/health") as r:
            assert r.status == 200
        await engine.aclose()
        async with http.get(srv.base + "/health") as r:
            assert r.status == 503 and (await r.json())["why"] == "the engine is closed"


async def _kept_alive(port: int):
    """A connection that has had one request answered (so the server holds it), now idle."""
    import asyncio

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    await reader.readexactly(length)
    return reader, writer


@pytest.mark.asyncio
async def test_past_the_cap_a_connection_gets_503(vault):
    """2,100 idle sockets took the server down until they closed (issue 30). Here a cap of
    3: the fourth connection gets a 503 and is closed; once one goes, there is room."""
    import asyncio

    options = ServerOptions(max_connections=3)
    async with Engine.open(vault.path) as engine, Running(engine, options) as srv:
        held = [await _kept_alive(srv.port) for _ in range(3)]
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        async with asyncio.timeout(10):
            busy = await reader.read()  # the 503, then the close (EOF)
        writer.close()
        assert busy.startswith(b"HTTP/1.1 503") and b"too_many_connections" in busy
        held[0][1].close()
        async with asyncio.timeout(10):
            await held[0][1].wait_closed()
            while True:  # the server sees it go, then takes a new one
                try:
                    held[0] = await _kept_alive(srv.port)
                    break
                except (asyncio.IncompleteReadError, ConnectionError):
                    await asyncio.sleep(0.01)
        for _, w in held:
            w.close()


@pytest.mark.asyncio
async def test_an_idle_connection_is_closed(vault):
    """Idle connections were held about an hour (aiohttp's default keep-alive, 3,630 s):
    one that never sends, one idle after a request, one whose head trickles in forever."""
    import asyncio

    # 2 s: long enough for the first request to be answered on a loaded machine first
    options = ServerOptions(idle_timeout_s=2.0)
    async with Engine.open(vault.path) as engine, Running(engine, options) as srv:
        silent = await asyncio.open_connection("127.0.0.1", srv.port)  # never sends
        served = await _kept_alive(srv.port)  # idle after a request
        slow = await asyncio.open_connection("127.0.0.1", srv.port)  # a head that never ends
        slow[1].write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")

        async def trickle() -> None:
            with contextlib.suppress(ConnectionError):
                while True:
                    slow[1].write(b"X-Slow: 1\r\n")
                    await slow[1].drain()
                    await asyncio.sleep(0.05)

        dripping = asyncio.create_task(trickle())
        async with asyncio.timeout(10):  # the server closes all three (EOF)
            assert await silent[0].read() == b""
            assert await served[0].read() == b""
            assert await slow[0].read() == b""
        dripping.cancel()
        for _, w in (silent, served, slow):
            w.close()
