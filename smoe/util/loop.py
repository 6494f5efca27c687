"""The event loop: uvloop where it is installed, asyncio's own otherwise; and, for a CLI
command, what SIGINT and SIGTERM do while it runs.

With ``signals`` on (the CLI turns it on for a command's duration, on the main thread):
the first SIGINT or SIGTERM cancels the command's task, so every ``async with`` and
``finally`` on the way out runs (the engine closes, the server ends its streams, counts are
saved); the command then raises KeyboardInterrupt (SIGINT) or Stopped (SIGTERM). A second
signal while that cleanup runs exits the process at once, after one line on stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

from smoe.errors import Stopped

T = TypeVar("T")

_signals = False  # set by ``signals()`` for a CLI command's duration


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # Windows, or a minimal install
        return None
    return uvloop.new_event_loop


@contextlib.contextmanager
def signals() -> Iterator[None]:
    """While inside, ``run`` on the main thread handles SIGINT and SIGTERM (module doc)."""
    global _signals
    saved, _signals = _signals, True
    try:
        yield
    finally:
        _signals = saved


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on a fresh uvloop (or asyncio) event loop."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        if _signals and threading.current_thread() is threading.main_thread():
            return runner.run(_stoppable(coro))
        return runner.run(coro)


async def _stoppable(coro: Coroutine[Any, Any, T]) -> T:
    """``coro``, cancelled by the first SIGINT or SIGTERM (module doc)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    received: list[int] = []

    def on_signal(sig: int) -> None:
        if received:  # a second signal during the cleanup: go now
            os.write(2, b"smoe: a second signal: exiting now, without cleaning up\n")
            os._exit(128 + sig)
        received.append(sig)
        task.cancel()

    handled = (signal.SIGINT, signal.SIGTERM)
    for sig in handled:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await coro
    except asyncio.CancelledError:
        if not received:
            raise
        if received[0] == signal.SIGTERM:
            raise Stopped() from None
        raise KeyboardInterrupt from None
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
