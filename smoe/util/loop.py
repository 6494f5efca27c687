"""The event loop: uvloop where it is installed, asyncio's own otherwise."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # Windows, or a minimal install
        return None
    return uvloop.new_event_loop


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on a fresh uvloop (or asyncio) event loop."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(coro)
