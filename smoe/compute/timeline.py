"""Where a decode step's host time goes, step by step (a per-step timeline).

A decode step that is built one ahead (``Runner.step`` and ``Runner.step_batch`` on a
resident model) spends its host time in three parts on the compute thread:

- ``build``: Python building the next pass's lazy graph (the model's layers, sampling);
- ``queue``: ``mx.async_eval`` of it, which on a GPU launches every kernel from this thread;
- ``wait``: reading this step's tokens back, i.e. waiting for the device to finish them.

and one part on the event loop, between the compute thread's return and the next step:

- ``loop``: handing out the tokens, the server's writes, the batcher's bookkeeping.

The device is the bound when ``wait`` is large; the host is when it is near zero, and then
the step's period is ``build + queue + wait + loop`` (plus the thread hand-off). Pure
Python, no MLX; each deque has one writer thread (the compute thread or the loop), and a
summary copies them (``list`` of a deque is safe against a concurrent append).
"""

from __future__ import annotations

import collections
import statistics
import time
from dataclasses import dataclass
from typing import Any

KEEP = 4096  # steps remembered: enough for a benchmark's run, bounded for a server


@dataclass(frozen=True)
class StepTime:
    """One decode step on the compute thread (seconds)."""

    rows: int  # sequences in the pass
    start: float  # perf_counter at the step's start
    build: float
    queue: float
    wait: float


class StepTimeline:
    """The last ``KEEP`` decode steps built ahead, and the loop's time between steps."""

    def __init__(self) -> None:
        self.steps: collections.deque[StepTime] = collections.deque(maxlen=KEEP)
        self.loop_gaps: collections.deque[float] = collections.deque(maxlen=KEEP)
        self._returned: float | None = None  # when the last step's job returned (loop side)

    def add(self, step: StepTime) -> None:
        """Compute thread: one step's parts."""
        self.steps.append(step)

    def returned(self) -> None:
        """Event loop: a decode step's job just came back."""
        self._returned = time.perf_counter()

    def next_step(self) -> None:
        """Event loop: the next decode step is about to be handed to the compute thread
        (the time since ``returned`` is the loop's share of the step)."""
        if self._returned is not None:
            self.loop_gaps.append(time.perf_counter() - self._returned)
            self._returned = None

    def idle(self) -> None:
        """Event loop: no step follows at once (the batch emptied); the gap is not a step's."""
        self._returned = None

    def clear(self) -> None:
        self.steps.clear()
        self.loop_gaps.clear()
        self._returned = None

    def summary(self) -> dict[str, Any]:
        """Medians in ms by rows per step: build, queue, wait, and ``period`` (start to
        the next step's start, over consecutive steps of the same rows); ``loop_ms``, the
        loop's median share of a step. JSON-ready."""
        steps = list(self.steps)
        by_rows: dict[int, dict[str, list[float]]] = {}
        for prev, step in zip([None, *steps], steps, strict=False):
            parts = by_rows.setdefault(
                step.rows, {"build": [], "queue": [], "wait": [], "period": []}
            )
            parts["build"].append(step.build)
            parts["queue"].append(step.queue)
            parts["wait"].append(step.wait)
            if prev is not None and prev.rows == step.rows:
                parts["period"].append(step.start - prev.start)
        rows = {
            str(n): {"steps": len(parts["build"])}
            | {f"{k}_ms": _median_ms(v) for k, v in parts.items()}
            for n, parts in sorted(by_rows.items())
        }
        return {"by_rows": rows, "loop_ms": _median_ms(list(self.loop_gaps))}


def _median_ms(values: list[float]) -> float | None:
    return round(statistics.median(values) * 1e3, 3) if values else None
