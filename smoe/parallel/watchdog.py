"""A watchdog over collectives: a rank that hangs must not hang the others forever.

A collective blocks inside MLX until every rank has joined it; a rank that died is
detected by the backend (a GroupError follows), but a rank that hangs (stopped, stuck on
a dead disk, partitioned away) is not, and a blocked collective cannot be interrupted
from Python. So a thread watches: when one collective has waited longer than ``timeout``
seconds, it calls ``on_hang(message)``, whose default prints the message as one line and
ends the process with GroupError's exit code: the launcher then ends the other ranks.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

from smoe.errors import GroupError


def end_process(message: str) -> None:  # pragma: no cover - ends the test process
    """Print ``message`` as the CLI prints errors and exit: nothing else can unblock us."""
    print(f"smoe: error: {message}", file=sys.stderr, flush=True)
    os._exit(GroupError.exit_code)


class Watchdog:
    """Calls ``on_hang`` once if a ``watch``ed block lasts longer than ``timeout`` s."""

    def __init__(
        self,
        timeout: float,
        on_hang: Callable[[str], None] = end_process,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout = timeout
        self.on_hang = on_hang
        self.clock = clock
        self._since: float | None = None
        self._what = ""
        self._fired = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watch(self, what: str) -> Iterator[None]:
        """Time the block (one at a time: the compute thread runs the collectives)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="smoe-watchdog", daemon=True)
            self._thread.start()
        self._what, self._since = what, self.clock()
        try:
            yield
        finally:
            self._since = None

    def check(self) -> bool:
        """Fire if the block in progress is late; True if it fired (now or before)."""
        since = self._since
        if not self._fired and since is not None and self.clock() - since > self.timeout:
            self._fired = True
            self.on_hang(
                f"the expert-parallel group is stuck: {self._what} waited more than "
                f"{self.timeout:g} s for the other ranks (one hangs or lost its network); "
                "check them, then restart every rank"
            )
        return self._fired

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            if self.check():
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
