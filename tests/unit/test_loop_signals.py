"""smoe.util.loop's signal rules for a CLI command, in process and deterministic: the
signal is sent from inside the coroutine at a chosen point, os._exit is recorded instead
of ending the test run."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

import smoe.util.loop as loop_module
from smoe.errors import Stopped


def _run_with_signals(coro):
    with loop_module.signals():
        return loop_module.run(coro)


@pytest.mark.parametrize(
    ("sig", "raised"), [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, Stopped)]
)
def test_the_first_signal_cancels_the_command_and_its_cleanup_runs(sig, raised):
    cleaned = []

    async def command():
        try:
            os.kill(os.getpid(), sig)
            await asyncio.sleep(30)  # cancelled by the signal
        finally:
            await asyncio.sleep(0)  # an async cleanup still runs
            cleaned.append(True)

    with pytest.raises(raised):
        _run_with_signals(command())
    assert cleaned == [True]


def test_a_second_signal_during_the_cleanup_exits_at_once(monkeypatch):
    """Was a traceback, and the cleanup's work lost silently (issue 30)."""
    exits = []
    done = asyncio.Event()

    def fake_exit(code):
        exits.append(code)
        done.set()  # (the real one never returns)

    monkeypatch.setattr(loop_module.os, "_exit", fake_exit)

    async def command():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(30)
        finally:
            os.kill(os.getpid(), signal.SIGINT)  # impatient: a second signal
            await done.wait()

    with pytest.raises(Stopped):
        _run_with_signals(command())
    assert exits == [128 + signal.SIGINT]


def test_without_the_cli_a_run_keeps_the_callers_handlers():
    """Outside `signals()` (scripts, tests, benchmarks) run() installs no handler."""

    async def probe():
        return signal.getsignal(signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    assert loop_module.run(probe()) == before
