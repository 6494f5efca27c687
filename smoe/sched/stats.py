"""Scheduler statistics: hits and misses (never mixed up with I/O errors), reads and bytes by
priority, and latency distributions."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

from smoe.sched.types import Priority


class Histogram:
    """Latency distribution in log-spaced buckets (1 us .. ~100 s): O(1) memory, percentiles
    to within one bucket (~12% apart)."""

    _EDGES = [1e-6 * (2 ** (i / 6)) for i in range(0, 6 * 27)]

    def __init__(self) -> None:
        self.counts = [0] * (len(self._EDGES) + 1)
        self.count = 0
        self.total = 0.0
        self.max = 0.0

    def add(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self._EDGES, seconds)] += 1
        self.count += 1
        self.total += seconds
        self.max = max(self.max, seconds)

    def percentile(self, q: float) -> float:
        """Upper edge of the bucket holding the q-th percentile (0 < q <= 100)."""
        if self.count == 0:
            return 0.0
        rank = math.ceil(self.count * q / 100)
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank:
                return min(self._EDGES[i] if i < len(self._EDGES) else self.max, self.max)
        return self.max

    def to_json(self) -> dict[str, float]:
        return {
            "count": self.count,
            "mean_ms": 1e3 * self.total / self.count if self.count else 0.0,
            "p50_ms": 1e3 * self.percentile(50),
            "p90_ms": 1e3 * self.percentile(90),
            "p99_ms": 1e3 * self.percentile(99),
            "max_ms": 1e3 * self.max,
        }


@dataclass
class PriorityCounters:
    reads: int = 0
    bytes: int = 0
    cancelled: int = 0
    queue_wait: Histogram = field(default_factory=Histogram)
    read_latency: Histogram = field(default_factory=Histogram)


@dataclass
class SchedulerStats:
    """Counters kept by the scheduler. A hit is a requested record found in the ring (READY
    or already LOADING); a miss needed a new read. I/O errors are counted apart."""

    hits: int = 0
    misses: int = 0
    io_errors: int = 0
    evictions: int = 0
    promotions: int = 0  # speculative reads that demand caught up with
    speculative_used: int = 0  # speculative loads later demanded (a useful bet)
    speculative_wasted: int = 0  # speculative loads evicted without demand asking
    speculative_declined: int = 0  # bets the governor refused (smoe.sched.governor)
    hints: int = 0  # resident keys passed to the policy's on_hint (router near misses)
    pins: int = 0  # slot pins taken (acquire, reserve, a resident lease)
    unpins: int = 0  # pins given back, counted as asked (before any check): a release
    # beyond its pins shows up here even where it is refused
    by_priority: dict[Priority, PriorityCounters] = field(
        default_factory=lambda: {p: PriorityCounters() for p in Priority}
    )

    @property
    def hit_rate(self) -> float:
        asked = self.hits + self.misses
        return self.hits / asked if asked else 0.0

    def bytes_read(self) -> int:
        return sum(c.bytes for c in self.by_priority.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hit_rate,
            "io_errors": self.io_errors,
            "evictions": self.evictions,
            "promotions": self.promotions,
            "speculative_used": self.speculative_used,
            "speculative_wasted": self.speculative_wasted,
            "speculative_declined": self.speculative_declined,
            "hints": self.hints,
            "bytes_read": self.bytes_read(),
            "by_priority": {
                p.name.lower(): {
                    "reads": c.reads,
                    "bytes": c.bytes,
                    "cancelled": c.cancelled,
                    "queue_wait": c.queue_wait.to_json(),
                    "read_latency": c.read_latency.to_json(),
                }
                for p, c in self.by_priority.items()
            },
        }
