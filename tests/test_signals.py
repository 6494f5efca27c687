"""Stopping a command by signal: SIGINT and SIGTERM end `smoe serve` with exit 130 and one
line, however the process was started. A shell starts a background job (`&`, `nohup`) with
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
    assert rc == 130, rest[-2000:]
    assert "Traceback" not in rest and "smoe serve: interrupted" in rest, rest[-2000:]


def test_the_cli_run_in_process_gives_the_callers_handlers_back(run_cli, vault):
    """`main` sets its own SIGINT/SIGTERM handlers for the command's duration only: a
    script or test that calls it keeps the dispositions it had (here: SIGINT ignored)."""
    before_term = signal.getsignal(signal.SIGTERM)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code, _, err = run_cli("inspect", vault.path)
        assert code == 0, err
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == before_term
    finally:
        signal.signal(signal.SIGINT, previous)


def test_serve_without_a_model_serves_the_demo_as_curl_asks(tmp_path):
    """As `smoe chat`: no model named, the built-in demo (made on first use). The start
    line names all three APIs; a body sent as `curl -d` sends it (a form content type)
    is served on Ollama's API."""
    import os

    env = {**os.environ, "SMOE_CACHE": str(tmp_path)}
    proc, base = _start_serving(None, env)
    try:
        body = json.dumps(
            {
                "model": "x",
                "messages": [{"role": "user", "content": "Who was Moses?"}],
                "stream": False,
                "options": {"num_predict": 4},
            }
        ).encode()
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        req = urllib.request.Request(base + "/api/chat", data=body, headers=form)
        with urllib.request.urlopen(req, timeout=120) as r:
            assert json.loads(r.read())["message"]["role"] == "assistant"
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.stderr is not None
    said = proc.stderr.read()
    assert "Traceback" not in said
    assert (tmp_path / "demo-kjv-qwen3-moe-v2").is_dir()  # the demo, made for it
