"""The streaming expert module that replaces mlx-lm's SwitchGLU/SwitchMLP in each MoE layer.

mlx-lm's MoE block computes the routing (gate, top-k, scores) and calls
``self.switch_mlp(x, indices)``; we keep that block and swap only the module it calls.
Ours evaluates the routing, asks the scheduler for the chosen experts' ring slots, and
runs mlx-lm's own expert computation on the ring views with expert ids remapped to slot
ids. The block then combines the outputs exactly as it would in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class Lease(Protocol):
    slots: list[int]  # one per requested expert, in request order
    ready: list[bool]  # which were READY when reserved

    def wait(self) -> None:
        """Block until every slot is READY (raises the read's error, slots released)."""
        ...


class SlotSource(Protocol):
    """Where the compute thread gets ring slots. Calls block the compute thread."""

    def acquire(self, layer: int, experts: list[int]) -> list[int]:
        """Pin and return the slots of ``experts`` once all are READY (order kept)."""
        ...

    def reserve(self, layer: int, experts: list[int]) -> Lease:
        """Pin the slots now and start the misses' reads; do not wait for them."""
        ...

    def release(self, slots: list[int]) -> None: ...

    def capacity(self) -> int:
        """Slots one request may pin at most (the ring size)."""
        ...


@dataclass
class LayerTrace:
    """What one streamed MoE call did (for statistics and tests)."""

    layer: int
    tokens: int
    unique_experts: int
    waves: int
    resident: int = 0  # experts already READY when asked for (computed while misses load)


@dataclass
class Tracer:
    calls: list[LayerTrace] = field(default_factory=list)
    on_routing: Callable[[int, np.ndarray], None] | None = None  # (layer, indices [T, k])


class StreamingExperts(nn.Module):
    """Drop-in for a SwitchGLU/SwitchMLP whose stacked parameters are ring views [S, ...].

    ``inner`` is mlx-lm's own module (quantized like the vault) with every parameter
    replaced by the ring's view of that component, so it computes on slots in place.
    """

    def __init__(
        self,
        inner: nn.Module,
        layer: int,
        num_experts: int,
        source: SlotSource,
        tracer: Tracer | None = None,
    ) -> None:
        super().__init__()
        # Kept out of the parameter tree: these are views of the ring, not model weights.
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_source", source)
        object.__setattr__(self, "_tracer", tracer)
        self.layer = layer
        self.num_experts = num_experts

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        # x: [..., D]; indices: [..., k] expert ids chosen by the router (exact top-k)
        idx = np.array(indices)  # evaluates the routing from the true hidden state
        if self._tracer is not None and self._tracer.on_routing is not None:
            self._tracer.on_routing(self.layer, idx.reshape(-1, idx.shape[-1]))
        experts = np.unique(idx).tolist()
        capacity = self._source.capacity()
        resident = 0
        if len(experts) <= capacity:
            y, resident = self._run_overlapped(x, idx, experts)
            waves = 1
        else:
            y, waves = self._run_in_waves(x, idx, experts, capacity)
        if self._tracer is not None:
            self._tracer.calls.append(
                LayerTrace(self.layer, int(np.prod(idx.shape[:-1])), len(experts), waves, resident)
            )
        return y

    def _run(self, x: mx.array, idx: np.ndarray, experts: list[int]) -> mx.array:
        slots = self._source.acquire(self.layer, experts)
        try:
            return self._compute(x, idx, experts, slots)
        finally:
            self._source.release(slots)

    def _run_overlapped(
        self, x: mx.array, idx: np.ndarray, experts: list[int]
    ) -> tuple[mx.array, int]:
        """Compute the experts already in the ring while the misses are being read.
        Returns the output and how many experts were resident."""
        lease = self._source.reserve(self.layer, experts)
        resident = int(sum(lease.ready))
        try:
            if resident in (0, len(experts)):
                lease.wait()
                return self._compute(x, idx, experts, lease.slots), resident
            # N = tokens, k = ranks, D = hidden, P = (token, rank) pairs of one part
            k = idx.shape[-1]
            flat_idx = idx.reshape(-1, k)
            flat_x = x.reshape(-1, x.shape[-1])
            out: mx.array | None = None
            was_ready = list(lease.ready)
            for first_part in (True, False):  # the resident experts, then the misses
                if not first_part:
                    lease.wait()
                part = [
                    (e, s)
                    for e, s, r in zip(experts, lease.slots, was_ready, strict=True)
                    if r == first_part
                ]
                rows, ranks = np.nonzero(np.isin(flat_idx, [e for e, _ in part]))
                y = self._compute(
                    flat_x[mx.array(rows)],
                    flat_idx[rows, ranks][:, None],
                    [e for e, _ in part],
                    [s for _, s in part],
                )  # [P, 1, D]
                if out is None:
                    out = mx.zeros((flat_idx.shape[0], k, y.shape[-1]), dtype=y.dtype)
                out[mx.array(rows), mx.array(ranks)] = y[:, 0]
                mx.eval(out)
            assert out is not None
            return out.reshape(*idx.shape, out.shape[-1]), resident
        finally:
            self._source.release(lease.slots)

    def _compute(
        self, x: mx.array, idx: np.ndarray, experts: list[int], slots: list[int]
    ) -> mx.array:
        """mlx-lm's expert computation on ring slots; evaluated before returning."""
        table = np.zeros(self.num_experts, dtype=np.uint32)
        table[experts] = slots
        y = self._inner(x, mx.array(table[idx]))
        mx.eval(y)  # the matmuls must be done reading the slots before they are released
        return y

    def _run_in_waves(
        self, x: mx.array, idx: np.ndarray, experts: list[int], capacity: int
    ) -> tuple[mx.array, int]:
        """The union does not fit the ring: run it in waves of at most ``capacity`` experts.

        Each wave computes exactly the (token, rank) pairs routed to its experts, one row
        per pair; the outputs are put back at their (token, rank) position, so the block's
        rank-order combination, and the total work, are those of a single pass.
        """
        # N = tokens, k = ranks, D = hidden, P = (token, rank) pairs in a wave
        k = idx.shape[-1]
        flat_idx = idx.reshape(-1, k)  # [N, k]
        flat_x = x.reshape(-1, x.shape[-1])  # [N, D]
        out: mx.array | None = None
        waves = 0
        for start in range(0, len(experts), capacity):
            wave = experts[start : start + capacity]
            rows, ranks = np.nonzero(np.isin(flat_idx, wave))  # [P], [P]
            pair_x = flat_x[mx.array(rows)]  # [P, D]
            y = self._run(pair_x, flat_idx[rows, ranks][:, None], wave)  # [P, 1, D]
            if out is None:
                out = mx.zeros((flat_idx.shape[0], k, y.shape[-1]), dtype=y.dtype)
            out[mx.array(rows), mx.array(ranks)] = y[:, 0]
            mx.eval(out)
            waves += 1
        assert out is not None
        return out.reshape(*idx.shape, out.shape[-1]), waves


def ring_module(original: nn.Module, views: dict[str, Any]) -> nn.Module:
    """``original`` (a SwitchGLU/SwitchMLP, quantized as the vault is) with each stacked
    parameter replaced by the ring view of the same component name."""
    from mlx.utils import tree_flatten, tree_unflatten

    names = {name for name, _ in tree_flatten(original.parameters())}
    missing = names - set(views)
    extra = set(views) - names
    if missing or extra:
        raise ValueError(
            f"vault record components {sorted(views)} do not match the model's expert "
            f"parameters {sorted(names)}"
        )
    original.update(tree_unflatten(list(views.items())))
    return original
