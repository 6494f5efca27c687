"""Stopping a command by signal: SIGINT ends `smoe serve` with exit 130 and SIGTERM with 0
(its normal end), one line each, however the process was started; streams in flight get
their end at once, the counts are saved, and a second signal exits at once. A shell starts a background job (`&`, `nohup`) with
SIGINT ignored, and an ignored disposition survives exec, so these servers are started
that way on purpose."""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import tiny_vault

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    return tiny_vault(tmp_path_factory.mktemp("signals"), seed=3)


def _ignore_sigint() -> None:
    """What `cmd &` in a non-interactive shell does to the job before exec."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_serving(
    vault: Path | None, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], str]:
    """`smoe serve` on a free port (``vault`` None: no model named), started as a
    background job; returns it once it listens (its start line read from stderr, no
    polling) and its base URL."""
    model = [] if vault is None else [str(vault)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "smoe.cli", "serve", *model, "--port", "0"],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ignore_sigint,
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        # the start line names each API's base
        found = re.search(
            r"on (http://[^\s:]+):(\d+) \(base URLs: OpenAI \S+/v1, Anthropic \S+, "
            r"Ollama \S+\);",
            line,
        )
        if found:
            return proc, f"{found.group(1)}:{found.group(2)}"
    proc.wait(timeout=60)
    raise AssertionError(f"smoe serve ended before listening (exit {proc.returncode})")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_backgrounded_server_stops_on_a_signal(vault, sig):
    proc, base = _start_serving(vault.path)
    try:
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}).encode()
        req = urllib.request.Request(
            base + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            assert json.loads(r.read())["choices"][0]["text"] is not None  # it served
        proc.send_signal(sig)
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.stderr is not None
    rest = proc.stderr.read()
    assert rc == (130 if sig == signal.SIGINT else 0), rest[-2000:]
    said = "interrupted" if sig == signal.SIGINT else "stopped (SIGTERM)"
    assert "Traceback" not in rest and f"smoe serve: {said}" in rest, rest[-2000:]


def _stream(base: str, i: int) -> list[bytes]:
    """A long streamed completion's lines, read until the server ends it."""
    body = json.dumps(
        {"prompt": [5, 6, 7 + i], "max_tokens": 2_000, "stream": True, "ignore_eos": True}
    ).encode()
    req = urllib.request.Request(
        base + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return list(r)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_streams_in_flight_end_at_once_and_the_counts_are_saved(tmp_path, sig):
    """Was: SIGTERM waited for every stream to run to its end (or crashed, exit 134), and
    saved the popularity counts only on SIGINT (issue 30)."""
    import threading

    vault = tiny_vault(tmp_path, seed=4)
    proc, base = _start_serving(vault.path)
    results: dict[int, list[bytes]] = {}
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, _stream(base, i)))
        for i in range(3)
    ]
    try:
        for th in threads:
            th.start()
        _until_generating(base, 3)
        proc.send_signal(sig)
        rc = proc.wait(timeout=60)
        for th in threads:
            th.join(timeout=60)
    finally:
        proc.kill()
    assert proc.stderr is not None
    rest = proc.stderr.read()
    assert rc == (130 if sig == signal.SIGINT else 0) and "Traceback" not in rest, rest[-2000:]
    for lines in results.values():
        events = [x for x in lines if x.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]\n" and b"shutting down" in events[-2]
    assert len(results) == 3
    assert (vault.path / "stats" / "popularity.npz").is_file()  # counts saved either way


def _until_generating(base: str, n: int) -> None:
    """Until ``n`` requests are in the batch (read from /health, as an operator would)."""
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with urllib.request.urlopen(base + "/health", timeout=10) as r:
            if json.loads(r.read())["active"] >= n:
                return
        time.sleep(0.05)
    raise AssertionError("the requests never started")


def _counting_stream(base: str, i: int, max_tokens: int, seen: list[int], ready) -> list[bytes]:
    """A streamed completion's lines, counting its data events into ``seen[i]`` and
    setting ``ready`` (a threading.Event) at each; a connection the server cuts ends it."""
    body = json.dumps(
        {"prompt": [5, 6, 7 + i], "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    ).encode()
    req = urllib.request.Request(
        base + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    lines: list[bytes] = []
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                lines.append(line)
                if line.startswith(b"data: "):
                    seen[i] += 1
                    ready.set()
    except (OSError, http.client.HTTPException):  # cut by a second signal's exit
        lines.append(b"<cut>")
    return lines


@pytest.mark.parametrize("seed", range(6))
def test_signals_at_random_points_of_a_served_batch(tmp_path, seed):
    """A seeded fuzzer (issue 30): 1-4 concurrent streams of 1-400 tokens, and SIGTERM or
    SIGINT once a chosen stream has had 0-24 events (so during prefill, decode, or after
    some streams ended), sometimes a second signal at once. Every round: the exit code of
    the signal, no traceback, every stream ended with [DONE] (its last token or the
    shutting-down error) unless a second signal ended the process at once, and the counts
    saved after one signal."""
    import random
    import threading

    rng = random.Random(seed)
    clients = rng.randint(1, 4)
    lengths = [rng.choice([1, 8, 40, 400]) for _ in range(clients)]
    watched, after = rng.randrange(clients), rng.randint(0, 24)
    sig = rng.choice([signal.SIGINT, signal.SIGTERM])
    twice = rng.random() < 0.3
    vault = tiny_vault(tmp_path, seed=5)
    proc, base = _start_serving(vault.path)
    seen = [0] * clients
    readies = [threading.Event() for _ in range(clients)]
    results: dict[int, list[bytes]] = {}

    def client(i: int) -> None:
        results[i] = _counting_stream(base, i, lengths[i], seen, readies[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    try:
        for th in threads:
            th.start()
        # The trigger is progress, not time: the watched stream's events (or its end).
        while seen[watched] < min(after, lengths[watched]) and threads[watched].is_alive():
            readies[watched].wait(timeout=1)
            readies[watched].clear()
        proc.send_signal(sig)
        if twice:
            proc.send_signal(sig)
        rc = proc.wait(timeout=60)
        for th in threads:
            th.join(timeout=60)
    finally:
        proc.kill()
    assert proc.stderr is not None
    rest = proc.stderr.read()
    case = f"seed {seed}: {clients} streams {lengths}, {sig.name} after {after} events"
    case += f" of stream {watched}{' twice' if twice else ''}"
    assert "Traceback" not in rest, f"{case}\n{rest[-2000:]}"
    assert rc in ((130 if sig == signal.SIGINT else 0),) + ((1, 2, 130) if twice else ()), (
        f"{case}: exit {rc}\n{rest[-2000:]}"
    )
    assert len(results) == clients, case
    for i, lines in results.items():
        events = [x for x in lines if x.startswith(b"data: ")]
        if twice and (lines[-1:] in ([], [b"<cut>"]) or events[-1:] != [b"data: [DONE]\n"]):
            continue  # the second signal ended the process at once: the stream is cut
        assert events and events[-1] == b"data: [DONE]\n", (
            f"{case}: stream {i}: {lines[-3:]}\n{rest[-3000:]}"
        )
        finished = b'"finish_reason": "length"' in b"".join(events)
        assert finished or b"shutting down" in events[-2], f"{case}: stream {i}: {events[-2:]}"
    if not twice:
        assert (vault.path / "stats" / "popularity.npz").is_file(), case
