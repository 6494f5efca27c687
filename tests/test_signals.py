"""Stopping a command by signal: SIGINT ends `smoe serve` with exit 130 and SIGTERM with 0
(its normal end), one line each, however the process was started; streams in flight get
their end at once, the counts are saved, and a second signal exits at once. A shell starts a background job (`&`, `nohup`) with
SIGINT ignored, and an ignored disposition survives exec, so these servers are started
that way on purpose."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import tiny_vault

ROOT = Path(__file__).resolve().parent.parent


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
            r"on (http://[^\s:]+):(\d+): OpenAI \S+/v1, Anthropic \S+/v1/messages, "
            r"Ollama \S+/api;",
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
