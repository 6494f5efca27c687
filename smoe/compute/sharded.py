"""One rank's part of an expert-parallel MoE layer (docs/distributed.md).

``ExpertShard``: the experts of one MoE layer this rank computes, and the sum over ranks
that completes the layer's output. ``ShardedSlots``: a SlotSource that keeps this rank's
speculation to its own experts (a guess about another rank's expert is that rank's to
read) and never serves a layer from a resident table (that path computes every expert).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class ExpertShard:
    """``owned[e]``: whether this rank computes expert e of the layer; ``reduce``: the sum
    over ranks of a [..., k, D] output to which each rank gave its own (token, rank) rows
    and exact zeros elsewhere."""

    owned: np.ndarray  # [E] bool
    reduce: Callable[[mx.array], mx.array]
    broken: Callable[[RuntimeError], Exception]  # the error to raise when reduce fails

    def mine(self, experts: list[int]) -> list[int]:
        return [e for e in experts if self.owned[e]]


class ShardedSlots:
    """Wraps a SlotSource for one rank: everything passes through, except that prefetches
    keep to the rank's experts and no layer is served from a resident table."""

    def __init__(self, source: Any, owned: dict[int, np.ndarray]) -> None:
        self._source = source
        self._owned = owned  # MoE layer -> [E] bool

    def acquire(self, layer: int, experts: list[int]) -> list[int]:
        return list(self._source.acquire(layer, experts))

    def reserve(self, layer: int, experts: list[int]) -> Any:
        return self._source.reserve(layer, experts)

    def release(self, slots: list[int]) -> None:
        self._source.release(slots)

    def capacity(self) -> int:
        return int(self._source.capacity())

    def prefetch(self, layer: int, experts: list[int]) -> None:
        mine = [e for e in experts if self._owned[layer][e]]
        if mine:
            self._source.prefetch(layer, mine)

    def cancel_speculative(self) -> None:
        self._source.cancel_speculative()

    def resident_table(self, layer: int) -> None:
        return None

    def count_resident(self, unique_experts: int) -> None:
        self._source.count_resident(unique_experts)

    @property
    def wait_seconds(self) -> float:
        return float(self._source.wait_seconds)
