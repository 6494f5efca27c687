"""Hostile values for every sizing option of generate, plan and serve (issue 30: the fuzzers
did not cover CLI options): each is refused in one line (ours or argparse's usage and
error), or runs cleanly; never a traceback, a crash or a hang. A valid value for `serve`
ends at a port taken on purpose, before anything loads."""

from __future__ import annotations

import socket

import pytest

from tests.conftest import tiny_vault

HOSTILE = [
    "-1",
    "0",
    "1",
    "1.5",
    "1e400",
    "nan",
    "inf",
    "-inf",
    "99999999999999999999",
    "abc",
    "",
    " ",
    "\u0661\u0662",
    "5GB",
    "-5GB",
    "NaNGB",
    "1e30B",
    "0x10",
    "１２",
]
GENERATE = [
    "--memory",
    "--slots",
    "--workers",
    "--read-parts",
    "--max-context",
    "--prefill-chunk",
    "--max-tokens",
    "--temp",
    "--top-p",
    "--top-k",
    "--min-p",
    "--max-batch",
    "--kv-bits",
    "--seed",
]
PLAN = ["--memory", "--context", "--max-batch", "--kv-bits", "--workers", "--prefill-chunk"]
SERVE = [
    "--port",
    "--max-queue",
    "--max-batch",
    "--idle-timeout",
    "--max-connections",
    "--prefix-cache",
    "--max-tokens",
    "--temp",
    "--top-p",
]


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    return tiny_vault(tmp_path_factory.mktemp("clifuzz"), seed=12)


@pytest.fixture(scope="module")
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _a_port(value: str) -> bool:
    try:
        return 0 <= int(value) <= 65535
    except ValueError:
        return False


def _run(run_cli, *argv: str) -> tuple[int, str]:
    try:
        code, _, err = run_cli(*argv)
    except SystemExit as e:  # argparse's own refusal: usage and one error line, exit 2
        return int(e.code or 0), ""
    return code, err


def _check(code: int, err: str, argv: tuple[str, ...], ok: tuple[int, ...] = (0, 1, 2)) -> None:
    assert code in ok, (argv, code, err[-800:])
    assert "Traceback" not in err, (argv, err[-800:])
    if code == 1 and "error:" in err:  # a refusal after parsing: one line (1 alone: no fit)
        assert len([ln for ln in err.splitlines() if ln.strip()]) == 1, (argv, err)


def test_generate_options(vault, run_cli, capsys):
    for option in GENERATE:
        for value in HOSTILE:
            argv = ("generate", str(vault.path), "--prompt-ids", "1,2", "--max-tokens", "1")
            argv += (option, value)
            code, err = _run(run_cli, *argv)
            capsys.readouterr()
            _check(code, err, argv)


def test_plan_options(vault, run_cli, capsys):
    for option in PLAN:
        for value in HOSTILE:
            argv = (
                "plan",
                str(vault.path),
                "--no-compute",
                "--probe-seconds",
                "0.05",
                option,
                value,
            )
            code, err = _run(run_cli, *argv)
            capsys.readouterr()
            _check(code, err, argv)  # 1 also where it does not fit (for scripts)


def test_serve_options(vault, run_cli, capsys, taken_port):
    for option in SERVE:
        for value in HOSTILE:
            argv = ("serve", str(vault.path), "--port", str(taken_port), option, value)
            if option == "--port":
                argv = ("serve", str(vault.path), option, value)
                if _a_port(value):  # a free port it would serve on (int() takes "１２" too)
                    continue
            code, err = _run(run_cli, *argv)
            capsys.readouterr()
            _check(code, err, argv)
            assert code in (1, 2), argv  # a valid value ends at the taken port, before loading
