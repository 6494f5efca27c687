"""`smoe chat` as a new user first runs it: no vault, a real terminal, one question.

The CLI runs in a pseudo-terminal (prompt_toolkit needs one) with an empty cache, so the
demo vault is converted on the way, and an empty MLX kernel cache, which the warm-up fills
before the prompt; the reply must be King James English, soon.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from smoe.chat.sampling import GREEDY, suggested_sampling

WORDS = set((Path(__file__).parents[1] / "data" / "kjv_words.txt").read_text().split())
_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]|\r")


def _read_until(fd: int, pattern: re.Pattern[str], timeout: float) -> str:
    seen, deadline = "", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                seen += os.read(fd, 65536).decode("utf-8", "replace")
            except OSError:
                break
            if pattern.search(_ESCAPES.sub("", seen)):
                return _ESCAPES.sub("", seen)
    raise AssertionError(f"no {pattern.pattern!r} within {timeout}s; got {seen[-2000:]!r}")


def test_smoe_chat_without_a_vault_answers_in_the_demos_language(tmp_path):
    primary, secondary = pty.openpty()
    (tmp_path / "tmp").mkdir()  # MLX's compiled kernels too start empty (TMPDIR/mlx)
    env = {
        **os.environ,
        "SMOE_CACHE": str(tmp_path),
        "TMPDIR": str(tmp_path / "tmp"),
        "TERM": "dumb",
        "COLUMNS": "200",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "smoe.cli", "chat", "--temp", "0", "--max-tokens", "48"],
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
        env=env,
        close_fds=True,
    )
    os.close(secondary)
    try:
        start = _read_until(primary, re.compile(r"Ctrl-D to quit"), 120)
        assert re.search(r"warming up the kernels \.\.\. \d+\.\d s\n", start), start
        asked = time.monotonic()
        os.write(primary, b"Hello, who are you?\r")
        # The reply, then the next prompt.
        seen = _read_until(primary, re.compile(r"Hello, who are you\?\n.*\w.*\n> ", re.S), 60)
        elapsed = time.monotonic() - asked
        os.write(primary, b"/quit\r")  # (a Ctrl-D typed before raw mode would be lost)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        os.close(primary)
    reply = seen.rsplit("Hello, who are you?", 1)[1]
    said = re.findall(r"[A-Za-z]+", reply.rsplit("\n> ", 1)[0])
    print(json.dumps({"first_reply_s": round(elapsed, 2), "reply": " ".join(said)}))
    assert len(said) >= 5 and sum(w.lower() in WORDS for w in said) / len(said) >= 0.9, reply
    assert elapsed < 20  # seconds; ~0.3 s measured on 2 cores (docs/demo-model.md)


def test_suggested_sampling_reads_generation_config_and_ignores_bad_values(tmp_path):
    def write(config: object) -> dict[str, float]:
        (tmp_path / "generation_config.json").write_text(json.dumps(config))
        return suggested_sampling(tmp_path)

    assert suggested_sampling(tmp_path) == GREEDY  # no file
    assert write({"do_sample": True, "temperature": 0.6, "top_p": 0.95}) == {
        "temperature": 0.6,
        "top_p": 0.95,
    }
    assert write({"temperature": 0.6}) == GREEDY  # no do_sample: greedy, as transformers
    assert write({"do_sample": True, "temperature": "hot", "top_p": 7}) == {
        "temperature": 1.0,
        "top_p": 1.0,
    }
    assert write({"do_sample": True, "temperature": float("nan")})["temperature"] == 1.0
    assert write([1, 2]) == GREEDY
    (tmp_path / "generation_config.json").write_text("{not json")
    assert suggested_sampling(tmp_path) == GREEDY


def test_the_start_line_says_where_the_sampling_came_from(tmp_path, run_cli, monkeypatch):
    """The start line says "the model's suggestion" only where generation_config.json asks
    to sample; greedy decoding by default is named as such (it was labelled so too), and
    at temperature 0 no top_p is named (it plays no part)."""
    import io

    from smoe.synth import synthesize
    from smoe.vault.convert import ConvertOptions, convert
    from tests.conftest import rewrite_side_file

    src = synthesize(tmp_path / "src", arch="qwen3_moe", preset="tiny", seed=52)
    (src / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.6}')
    vault = convert(src, tmp_path / "v", ConvertOptions(dtype="float32")).path
    said = []
    for config in ({"do_sample": True, "temperature": 0.6}, {"do_sample": False}, None):
        data = None if config is None else json.dumps(config).encode()
        rewrite_side_file(vault, "generation_config.json", data)  # as a source with it
        monkeypatch.setattr("sys.stdin", io.StringIO(""))  # piped, and at its end at once
        code, _, err = run_cli("chat", vault, "--no-warm-up")
        assert code == 0, err
        said.append(next(line for line in err.splitlines() if "sampling at" in line))
    assert said[0].endswith(
        "temperature 0.6, top_p 1 (the model's suggestion, from its generation_config.json)"
    )
    assert said[1].endswith("(greedy: the model's generation_config.json does not sample)")
    none = "(greedy: the model suggests none, having no generation_config.json)"
    assert said[2].endswith(f"temperature 0 {none}")  # (top_p plays no part at 0)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    code, _, err = run_cli("chat", vault, "--no-warm-up", "--temp", "0", "--top-p", "0.9")
    assert code == 0, err
    asked = next(line for line in err.splitlines() if "sampling at" in line)
    assert asked.endswith("sampling at temperature 0 (greedy)"), asked  # no top_p named


def test_piped_chat_is_plain_lines(tmp_path):
    """Standard input that is not a terminal: each line a message, each reply a line on
    stdout, with no prompt, status bar or terminal codes (it filled the output before)."""
    env = {**os.environ, "SMOE_CACHE": str(tmp_path), "TERM": "xterm"}
    done = subprocess.run(
        [sys.executable, "-m", "smoe.cli", "chat", "--temp", "0", "--max-tokens", "16"],
        input="Who was Moses?\n\n/stats\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "not a terminal" not in done.stderr  # no prompt_toolkit session was made
    # the start line's dtype reads plainly: the demo's weights are float32 already
    assert "computing in float32 (the weights' dtype, as mlx-lm runs them)" in done.stderr
    out = done.stdout
    assert "\x1b" not in out and "\r" not in out and "> " not in out
    reply, stats = out.split("\n", 1)
    said = re.findall(r"[A-Za-z]+", reply)
    assert len(said) >= 5 and sum(w.lower() in WORDS for w in said) / len(said) >= 0.9, reply
    assert stats.startswith("ring: ")  # the /stats command ran, in plain text too


def _controlling_terminal() -> None:
    """The child's own session with the pty as its controlling terminal, so that ^C typed
    there is SIGINT to it, as in a real terminal."""
    import fcntl
    import termios

    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


@contextlib.contextmanager
def _long_reply_streaming(tmp_path, controlling: bool = False) -> Iterator[tuple[int, Any]]:
    """`smoe chat` in a pty, greedy, with a reply under way that runs to its 400 tokens
    (the demo's answer to this question): yields (the pty's fd, the process)."""
    primary, secondary = pty.openpty()
    env = {**os.environ, "SMOE_CACHE": str(tmp_path), "TERM": "dumb", "COLUMNS": "200"}
    argv = ["chat", "--temp", "0", "--max-tokens", "400", "--no-warm-up"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "smoe.cli", *argv],
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
        env=env,
        close_fds=True,
        preexec_fn=_controlling_terminal if controlling else None,
    )
    os.close(secondary)
    try:
        _read_until(primary, re.compile(r"Ctrl-D to quit"), 120)
        os.write(primary, b"Tell me of the generations of Adam.\r")
        _read_until(primary, re.compile(r"of Adam\.\n\s*\w+ \w+"), 60)  # it streams
        yield primary, proc
    finally:
        proc.kill()
        os.close(primary)


def test_keys_typed_during_a_reply_are_not_echoed_into_it(tmp_path):
    """Keys typed while a reply streams are not echoed into it (the terminal's ECHO is
    off then); they wait for the next prompt, as type-ahead."""
    with _long_reply_streaming(tmp_path) as (primary, proc):
        os.write(primary, b"zzqq")  # typed while the reply streams
        seen = _read_until(primary, re.compile(r"\n> .*zzqq", re.S), 120)
        os.write(primary, b"\x15/quit\r")  # Ctrl-U clears the type-ahead first
        proc.wait(timeout=30)
    rest_of_reply = seen.rsplit("\n> ", 1)[0]  # what streamed after the keys were typed
    assert len(re.findall(r"\w+", rest_of_reply)) > 20  # the keys came mid-reply
    assert "zzqq" not in rest_of_reply, rest_of_reply  # it waits at the next prompt


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(tmp_path):
    with _long_reply_streaming(tmp_path, controlling=True) as (primary, proc):
        os.write(primary, b"\x03")  # ^C, with ECHO off for the reply: still SIGINT
        _read_until(primary, re.compile(r"\[reply cancelled\]\n> "), 30)
        os.write(primary, b"/quit\r")
        assert proc.wait(timeout=30) == 0
