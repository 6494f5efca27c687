"""`smoe serve` in a storm (issue 49), inside a memory cgroup of exactly its --memory
(swap off: going over is an OOM kill): 512 clients stall request bodies (half of them
large), others reset their connections before the headers, and concurrent clients of the
three APIs ask greedy questions, a third of them cancelled mid-stream and some streamed
to their end. Every completed answer equals its solo run, /health answers throughout, the log holds no traceback, the
server is not killed and its peak RSS stays within the budget. Bounded in count and time
(seeded)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from tests.cgroup import limited_popen
from tests.conftest import tiny_vault

REPO = Path(__file__).resolve().parents[2]
STALLS = 512
CLIENTS = 48
RESETS = 24
MAX_CONNECTIONS = STALLS + CLIENTS + RESETS + 16
PROMPTS = ["Hello", "Tell me a story", "What is two and two?", "Name a colour"]


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    return tiny_vault(tmp_path_factory.mktemp("storm"), seed=50)


def smallest_budget(run_cli, vault: Path) -> int:
    """The smallest --memory `smoe serve` takes with these connections, as it names it."""
    code, _, err = run_cli(
        "serve", vault, "--memory", "1MB", "--port", "0", "--max-connections", MAX_CONNECTIONS
    )
    named = re.search(r"smallest that works is --memory (\d+)MB", err)
    assert code == 1 and named is not None, err
    return int(named.group(1)) * 10**6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def request(api: str, prompt: str, stream: bool) -> tuple[str, dict]:
    messages = [{"role": "user", "content": prompt}]
    if api == "openai":
        body = {"messages": messages, "max_tokens": 8, "temperature": 0, "stream": stream}
        return "/v1/chat/completions", body
    if api == "anthropic":
        body = {"model": "m", "messages": messages, "max_tokens": 8, "temperature": 0}
        return "/v1/messages", {**body, "stream": stream}
    options = {"temperature": 0, "num_predict": 8}
    return "/api/chat", {"model": "m", "messages": messages, "stream": stream, "options": options}


def text_of(api: str, answer: dict) -> str:
    if api == "openai":
        return str(answer["choices"][0]["message"]["content"])
    if api == "anthropic":
        return "".join(b["text"] for b in answer["content"] if b["type"] == "text")
    return str(answer["message"]["content"])


async def ask(http: aiohttp.ClientSession, base: str, api: str, prompt: str) -> str:
    path, body = request(api, prompt, stream=False)
    async with http.post(base + path, json=body) as r:
        assert r.status == 200, await r.text()
        return text_of(api, await r.json())


async def ask_streamed(http: aiohttp.ClientSession, base: str, prompt: str) -> str:
    """An OpenAI chat streamed to its end: the text of its deltas."""
    path, body = request("openai", prompt, stream=True)
    pieces = []
    async with http.post(base + path, json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            data = line.decode().strip().removeprefix("data: ")
            if data.startswith("{"):
                delta = json.loads(data)["choices"][0]["delta"]
                pieces.append(delta.get("content") or "")
    return "".join(pieces)


async def cancel_mid_stream(http: aiohttp.ClientSession, base: str, api: str, prompt: str) -> None:
    path, body = request(api, prompt, stream=True)
    async with http.post(base + path, json=body) as r:
        await r.content.readany()  # the first event, then gone
        r.close()


def reset_before_headers(port: int, api: str, prompt: str) -> None:
    path, body = request(api, prompt, stream=True)
    raw = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    s.sendall(head.encode() + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()  # an RST, before the server has answered


def stall(port: int, large: bool) -> socket.socket:
    length = 4 * 2**20 if large else 60_000
    s = socket.create_connection(("127.0.0.1", port))
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    s.sendall((head + f"Content-Length: {length}\r\n\r\n").encode())
    s.setblocking(False)
    sent = 0
    try:
        while sent < length - 1:
            sent += s.send(b" " * min(2**16, length - 1 - sent))
    except (BlockingIOError, ConnectionError):
        pass  # the server stopped reading (or refused it: 503 and closed)
    return s


async def poll_health(base: str, stop: asyncio.Event, failures: list[str]) -> int:
    answered = 0
    async with aiohttp.ClientSession() as http:
        while not stop.is_set():
            try:
                async with http.get(base + "/health", timeout=aiohttp.ClientTimeout(10)) as r:
                    if r.status != 200:
                        failures.append(f"/health {r.status}")
                    answered += 1
            except (aiohttp.ClientError, TimeoutError) as e:
                failures.append(f"/health {type(e).__name__}")
            await asyncio.sleep(0.05)
    return answered


def peak_rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]


async def storm(port: int, seed: int) -> tuple[dict, list[str], int]:
    base = f"http://127.0.0.1:{port}"
    rng = random.Random(seed)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CLIENTS)) as http:
        solo = {
            (a, p): await ask(http, base, a, p)
            for a in ("openai", "anthropic", "ollama")
            for p in PROMPTS
        }
        loop = asyncio.get_running_loop()
        stalls = [await loop.run_in_executor(None, stall, port, i % 2 == 0) for i in range(STALLS)]
        stop, failures = asyncio.Event(), []
        health = asyncio.create_task(poll_health(base, stop, failures))
        jobs, expected = [], []
        for _ in range(CLIENTS):
            api, prompt = rng.choice(list(solo))
            if rng.random() < 1 / 3:
                jobs.append(cancel_mid_stream(http, base, api, prompt))
                expected.append(None)
            elif api == "openai" and rng.random() < 1 / 2:  # a stream that runs to its end
                jobs.append(ask_streamed(http, base, prompt))
                expected.append(solo[(api, prompt)])
            else:
                jobs.append(ask(http, base, api, prompt))
                expected.append(solo[(api, prompt)])
        for _ in range(RESETS):
            api, prompt = rng.choice(list(solo))
            jobs.append(loop.run_in_executor(None, reset_before_headers, port, api, prompt))
            expected.append(None)
        results = await asyncio.gather(*jobs)
        stop.set()
        answered = await health
        for s in stalls:
            s.close()
    wrong = [
        (want, got) for want, got in zip(expected, results, strict=True) if want and want != got
    ]
    completed = sum(1 for want in expected if want)
    return {"completed": completed, "wrong": wrong, "solo": len(solo)}, failures, answered


def test_a_storm_inside_a_container_of_the_budget(vault, run_cli):
    budget = smallest_budget(run_cli, vault.path)
    port = free_port()
    cmd = [sys.executable, "-m", "smoe.cli", "serve", str(vault.path), "--port", str(port)]
    cmd += ["--memory", str(budget), "--max-connections", str(MAX_CONNECTIONS)]
    cmd += ["--max-queue", str(CLIENTS + RESETS)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with limited_popen(cmd, budget, stderr=subprocess.PIPE, text=True, env=env) as run:
        if run is None:
            pytest.skip("cannot create a memory cgroup here (needs root and a memory controller)")
        process, counts = run
        assert process.stderr is not None
        started = time.monotonic()
        for line in process.stderr:  # until it listens
            if "serving" in line:
                break
            assert time.monotonic() - started < 300 and process.poll() is None, line
        report, failures, answered = asyncio.run(storm(port, seed=49))
        peak = peak_rss(process.pid)
        process.send_signal(signal.SIGTERM)
        log = process.stderr.read()
        process.wait(60)
        cgroup_peak, kills = counts()
    print(f"budget {budget}, peak RSS {peak}, cgroup {cgroup_peak}, /health {answered}, {report}")
    assert kills == 0 and process.returncode == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert report["wrong"] == [] and report["completed"] > CLIENTS // 3, report
    assert failures == [] and answered > 0, failures
    assert peak <= budget, f"peak RSS {peak} above the budget {budget}"
