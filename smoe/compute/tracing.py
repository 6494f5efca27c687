"""What streamed MoE layers share beyond their weights, and what they report.

``Tracer`` holds the speculation settings and the model wiring (routers, next layer), the
routing observers (``TraceObservers``: test hooks, the archive recorder, popularity,
hints) and bounded counters (``TraceCounters``: the newest ``CALLS_KEPT`` calls, so a
server running for days keeps no more). The engine owns one; every streamed layer reads it.

The state of one forward pass (``PassState``: its phase, router logits on their way to
the layer that reads them, lookahead predictions, routing to count) is not on the
Tracer: the runner opens a ``forward_pass`` around each model call and the layers read
it with ``current_pass()`` (a ContextVar, as ``solo_rows`` is), so it ends with the pass
and nothing of a failed or dropped pass outlives it. Routing served from resident tables
is counted after the pass is evaluated (``DeferredRouting``): one small copy, no device
sync.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np


@dataclass
class WaveTime:
    """One wave of a streamed call whose experts did not fit the ring at once."""

    experts: int
    wait_s: float  # blocked until its slots were READY (reads)
    compute_s: float  # its expert matmuls, evaluated


@dataclass
class LayerTrace:
    """What one streamed MoE call did (statistics, tests, the prefill timeline). Times
    are host wall seconds on the compute thread; zero where the call was not timed
    (routing counted after a pass served from resident tables)."""

    layer: int
    tokens: int
    unique_experts: int
    waves: int
    resident: int = 0  # experts already READY when asked for (computed while misses load)
    phase: int = 0  # 0 prefill, 1 decode
    route_s: float = 0.0  # evaluating the routing: the layer's attention and router
    wait_s: float = 0.0  # blocked on reads of its experts
    seconds: float = 0.0  # the whole call, routing included
    wave_times: list[WaveTime] = field(default_factory=list)  # when waves > 1


# The newest MoE calls a Tracer keeps (tests and benchmarks read them); a server running
# for days keeps no more than this.
CALLS_KEPT = 8192


@dataclass
class TraceCounters:
    """What the streamed passes did, for tests, benchmarks and the REPL's status line."""

    calls: deque[LayerTrace] = field(default_factory=lambda: deque(maxlen=CALLS_KEPT))
    unique_experts: int = 0  # distinct experts summed over every (pass, MoE layer)
    lookahead_hits: int = 0  # experts the lookahead predicted that the layer then used
    lookahead_total: int = 0  # experts the layers used where a prediction was made

    @property
    def lookahead_recall(self) -> float:
        return self.lookahead_hits / self.lookahead_total if self.lookahead_total else 0.0


@dataclass
class TraceObservers:
    """Who is told about routing decisions (each optional)."""

    on_routing: Callable[[int, np.ndarray], None] | None = None  # (layer, indices [T, k])
    recorder: Any = None  # an ArchiveRecorder while a routing archive is being recorded
    popularity: Any = None  # a smoe.sched.popularity.Popularity counting demand
    # Router hints (smoe.sched.hints): after each streamed MoE call, hint(layer, experts)
    # gets the experts of gate ranks top_k .. hint_depth-1 that no token of it used.
    hint: Callable[[int, list[int]], None] | None = None


@dataclass
class PassState:
    """State of one forward pass, set and consumed within it (``forward_pass``)."""

    phase: int = 0  # 0 prefill, 1 decode: decode-only work (lookahead, bets) needs 1
    gates: dict[int, mx.array] = field(default_factory=dict)  # router logits, per layer
    predicted: dict[int, set[int]] = field(default_factory=dict)  # lookahead, per layer
    # Routing of layers served from resident tables, counted after the pass (no sync).
    deferred: list[tuple[int, mx.array, Any]] = field(default_factory=list)
    archive_batch: int | None = None  # this pass's batch in a routing archive being recorded


_PASS: ContextVar[PassState | None] = ContextVar("smoe_forward_pass", default=None)


@contextmanager
def forward_pass(phase: int) -> Iterator[PassState]:
    """The state of one forward pass (phase 0 prefill, 1 decode) for the MoE layers run or
    built inside the block, in this thread or task only. The caller takes the routing to
    count from the state it yields (``Tracer.take``) once the pass is built; whatever is
    left when the block ends (a failed pass, leftover logits) is dropped with it."""
    state = PassState(phase=phase)
    token = _PASS.set(state)
    try:
        yield state
    finally:
        _PASS.reset(token)


def current_pass() -> PassState:
    """The state of the enclosing ``forward_pass``. Outside one (a test calling the model
    directly) a fresh state each call: a prefill's, so no decode-only work runs, and
    nothing the layer defers is counted."""
    state = _PASS.get()
    return state if state is not None else PassState()


@dataclass
class Tracer:
    """What the streamed MoE layers share beyond their own weights: the speculation
    settings and model wiring (fields here), the observers of routing, the state of the
    pass in progress and the counters, each its own small object."""

    spec: int = 0  # gate-echo bets per layer and decode step (0: off)
    lookahead: bool = False  # predict layer n+1's experts from layer n's input (decode)
    hint_depth: int = 0  # gate ranks hinted (observers.hint)
    first_layer: int = 0  # the first MoE layer: its call starts a new batch in the archive
    routers: dict[int, Any] = field(default_factory=dict)  # layer -> its router module
    next_layer: dict[int, int] = field(default_factory=dict)  # MoE layer -> next MoE layer
    num_experts: int = 0  # routed experts per MoE layer (set by build_model)
    observers: TraceObservers = field(default_factory=TraceObservers)
    counters: TraceCounters = field(default_factory=TraceCounters)

    @property
    def lookahead_recall(self) -> float:
        return self.counters.lookahead_recall

    def wants_gates(self) -> bool:
        """Whether router logits are kept for the host (archives, gate echo, hints)."""
        o = self.observers
        return o.recorder is not None or bool(self.spec) or o.hint is not None

    def needs_routing_now(self) -> bool:
        """Whether a layer's routing must reach the host during the pass (archives,
        test hooks and gate-echo bets read it there)."""
        o = self.observers
        return o.recorder is not None or o.on_routing is not None or bool(self.spec)

    def take(self, state: PassState) -> DeferredRouting | None:
        """The routing ``state``'s pass deferred, as the layers' chosen expert ids in one
        lazy array; evaluate ``ids`` with the pass and ``count`` it then: reading it back
        costs one small copy, no device sync. One device op per pass: the histogram is
        counted on the host (each extra small kernel costs host launch time on a GPU:
        docs/performance.md)."""
        deferred, state.deferred = state.deferred, []
        if not deferred:
            return None
        assert self.num_experts > 0, "build_model sets num_experts"
        ids = mx.concatenate([i.reshape(-1) for _, i, _ in deferred])  # [sum of rows*k]
        rows = [i.size // i.shape[-1] for _, i, _ in deferred]
        sizes = [i.size for _, i, _ in deferred]
        return DeferredRouting([(layer, src) for layer, _, src in deferred], rows, ids, sizes)

    def count(self, routing: DeferredRouting | None) -> None:
        """Count ``routing`` (``take``'s) of a pass that has been evaluated."""
        if routing is None:
            return
        flat = np.array(routing.ids)  # [sum of rows*k]
        bounds = np.cumsum(routing.sizes)[:-1]
        hist = np.stack(  # [L, E]
            [np.bincount(part, minlength=self.num_experts) for part in np.split(flat, bounds)]
        )
        if self.observers.popularity is not None:
            self.observers.popularity.add_counts([layer for layer, _ in routing.layers], hist)
        unique = (hist > 0).sum(axis=1)
        for (layer, source), rows, n in zip(
            routing.layers, routing.rows, unique.tolist(), strict=True
        ):
            source.count_resident(n)
            self.counters.calls.append(LayerTrace(layer, rows, n, 1, n))
            self.counters.unique_experts += n


@dataclass
class DeferredRouting:
    """One pass's routing through resident tables, counted once the pass is evaluated."""

    layers: list[tuple[int, Any]]  # (MoE layer, its SlotSource), in pass order
    rows: list[int]  # tokens routed, per layer
    ids: mx.array  # [sum of sizes]: each layer's chosen expert ids, layer after layer
    sizes: list[int]  # ids per layer (rows * k)
