"""The streaming expert module that replaces mlx-lm's SwitchGLU/SwitchMLP in each MoE layer.

mlx-lm's MoE block computes the routing (gate, top-k, scores) and calls
``self.switch_mlp(x, indices)``; we keep that block and swap only the module it calls.
Ours evaluates the routing, asks the scheduler for the chosen experts' ring slots, and
runs mlx-lm's own expert computation on the ring views with expert ids remapped to slot
ids. The block then combines the outputs exactly as it would in memory.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from smoe.errors import VaultError
from smoe.sched.hints import runner_ups


class Lease(Protocol):
    """Pinned slots of one request. Whoever reserved it releases it exactly once, with
    ``release()`` in a ``finally``; ``wait`` and ``wait_any`` never release, also when
    they raise."""

    slots: list[int]  # one per requested expert, in request order
    ready: list[bool]  # which are known to be READY

    def wait(self) -> None:
        """Block until every slot is READY (raises the read's error; releases nothing)."""
        ...

    def wait_any(self, positions: list[int]) -> list[int]:
        """Block until some of ``positions`` are READY; return those that are."""
        ...

    def release(self) -> None:
        """Unpin the slots (idempotent)."""
        ...


class SlotSource(Protocol):
    """Where the compute thread gets ring slots. Calls block the compute thread."""

    def acquire(self, layer: int, experts: list[int]) -> list[int]:
        """Pin and return the slots of ``experts`` once all are READY (order kept); the
        caller then releases them with ``release``. A read error (ReadError) is raised
        after the pins are released here."""
        ...

    def reserve(self, layer: int, experts: list[int]) -> Lease:
        """Pin the slots now and start the misses' reads; do not wait for them. The caller
        releases the Lease (``Lease.release``), not its slots."""
        ...

    def release(self, slots: list[int]) -> None:
        """Unpin slots from ``acquire``."""
        ...

    def capacity(self) -> int:
        """Slots one request may pin at most (the ring size)."""
        ...

    def prefetch(self, layer: int, experts: list[int]) -> None:
        """Queue speculative reads (never waits; demand stays first)."""
        ...

    def cancel_speculative(self) -> None:
        """Drop queued speculative reads that have not started."""
        ...

    def resident_table(self, layer: int) -> tuple[int, mx.array] | None:
        """Once every expert is resident for good: the bank holding ``layer``'s experts and
        the [E] uint32 slot in it of each, on the device; else None."""
        ...

    def count_resident(self, unique_experts: int) -> None:
        """Count experts served by resident tables (hits the scheduler never saw)."""
        ...


@dataclass
class LayerTrace:
    """What one streamed MoE call did (for statistics and tests)."""

    layer: int
    tokens: int
    unique_experts: int
    waves: int
    resident: int = 0  # experts already READY when asked for (computed while misses load)


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
    """State of the forward pass in progress, set and consumed within it."""

    phase: int = 0  # 0 prefill, 1 decode: set by the runner before each forward pass
    gates: dict[int, mx.array] = field(default_factory=dict)  # router logits, per layer
    predicted: dict[int, set[int]] = field(default_factory=dict)  # lookahead, per layer
    # Routing of layers served from resident tables, counted after the pass (no sync).
    deferred: list[tuple[int, mx.array, Any]] = field(default_factory=list)


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
    step: PassState = field(default_factory=PassState)
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

    def flush(self) -> None:
        """Count the deferred routing of the pass just evaluated (popularity, distinct
        experts, traces); call after each forward pass has been evaluated."""
        self.count(self.take())

    def take(self) -> DeferredRouting | None:
        """The routing deferred since the last take (one pass's, when taken after each
        pass is built), as a lazy per-layer histogram; evaluate ``counts`` with the pass
        and ``count`` it then: reading it back costs one small copy, no device sync."""
        deferred, self.step.deferred = self.step.deferred, []
        if not deferred:
            return None
        assert self.num_experts > 0, "build_model sets num_experts"
        ids = mx.arange(self.num_experts)

        def histogram(flat: mx.array) -> mx.array:  # [..., N] ids -> [..., E] counts
            return (flat[..., None] == ids).astype(mx.int32).sum(-2)

        if len({i.shape for _, i, _ in deferred}) == 1:  # one pass: one op for all layers
            hist = histogram(mx.stack([i.reshape(-1) for _, i, _ in deferred]))
        else:
            hist = mx.stack([histogram(i.reshape(-1)) for _, i, _ in deferred])
        rows = [i.size // i.shape[-1] for _, i, _ in deferred]
        return DeferredRouting([(layer, src) for layer, _, src in deferred], rows, hist)

    def count(self, routing: DeferredRouting | None) -> None:
        """Count ``routing`` (``take``'s) of a pass that has been evaluated."""
        if routing is None:
            return
        hist = np.array(routing.counts)  # [L, E]
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
    counts: mx.array  # [L, E] int32: times each layer chose each expert


class RouterTap(nn.Module):
    """Wraps a MoE block's router so its logits can be read for the routing archive."""

    def __init__(self, router: nn.Module, layer: int, tracer: Tracer) -> None:
        super().__init__()
        self.router = router
        object.__setattr__(self, "_tracer", tracer)
        object.__setattr__(self, "_layer", layer)

    def __call__(self, x: mx.array) -> mx.array:
        out = self.router(x)
        # Some routers (DeepSeek's MoEGate) return (indices, scores), not logits.
        if isinstance(out, mx.array) and self._tracer.wants_gates():
            self._tracer.step.gates[self._layer] = out
        return out


def gate_ranking(gates: np.ndarray, used: np.ndarray, depth: int) -> np.ndarray:
    """[T, depth] expert ids: the experts used (by descending gate score), then the rest.

    gates: [T, E] router logits; used: [T, k] the experts the block chose.
    """
    t, e = gates.shape
    order = np.argsort(-gates, axis=-1, kind="stable")  # [T, E]
    is_used = np.zeros((t, e), bool)
    np.put_along_axis(is_used, used, True, axis=-1)
    used_first = np.take_along_axis(is_used, order, axis=-1)
    # stable sort on "not used" keeps gate order within the used and within the rest
    ranked = np.take_along_axis(order, np.argsort(~used_first, axis=-1, kind="stable"), -1)
    return ranked[:, :depth]


@dataclass
class _Seen:
    """What one streamed call's routing asks for once its experts are served."""

    hints: list[int] = field(default_factory=list)  # experts to hint (runner-ups)
    bets: tuple[np.ndarray, np.ndarray] | None = None  # (gate logits, top-k): gate echo


class StreamingExperts(nn.Module):
    """Drop-in for a SwitchGLU/SwitchMLP whose stacked parameters are ring arrays [S_b, ...].

    ``inners[b]`` is mlx-lm's own module (quantized like the vault) with every parameter
    replaced by bank b's array of that component, so it computes on slots in place;
    ``locate(slot)`` gives a slot's (bank, slot in bank). One bank is the common case.
    """

    def __init__(
        self,
        inners: list[nn.Module],
        locate: Callable[[int], tuple[int, int]],
        layer: int,
        num_experts: int,
        source: SlotSource,
        tracer: Tracer | None = None,
        overlap: bool = True,
    ) -> None:
        super().__init__()
        # overlap: compute each expert as its read completes. Exact only where kernels
        # compute rows independently of the call's shape (the CPU); on a GPU the layer
        # runs as one call once all its experts are READY, as mlx-lm calls it.
        self.overlap = overlap
        # Kept out of the parameter tree: these are the ring's arrays, not model weights.
        object.__setattr__(self, "_inners", inners)
        object.__setattr__(self, "_locate", locate)
        object.__setattr__(self, "_source", source)
        object.__setattr__(self, "_tracer", tracer)
        self.layer = layer
        self.num_experts = num_experts

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """Route -> reserve -> compute -> release, then tell the observers and speculate."""
        # x: [..., D]; indices: [..., k] expert ids chosen by the router (exact top-k)
        tracer = self._tracer
        resident = self._source.resident_table(self.layer)
        if resident is not None and not (tracer is not None and tracer.needs_routing_now()):
            # Every expert is resident for good: no reads to schedule, so the routing
            # need not reach the host; the slot ids are gathered on the device, and
            # mlx-lm's call is the same one it makes in memory.
            if tracer is not None:
                tracer.step.deferred.append((self.layer, indices, self._source))
                tracer.step.gates.pop(self.layer, None)  # kept for hints: none needed here
            bank, table = resident
            return self._inners[bank](x, table[indices])
        idx = np.array(indices)  # evaluates the routing from the true hidden state
        seen = self._observe(idx) if tracer is not None else _Seen()
        experts = np.unique(idx).tolist()
        capacity = self._source.capacity()
        in_ring = 0
        if len(experts) <= capacity:
            run = self._run_overlapped if self.overlap else self._run_whole
            y, in_ring = run(x, idx, experts)
            waves = 1
        else:
            y, waves = self._run_in_waves(x, idx, experts, capacity)
        if tracer is not None:
            self._after(tracer, x, idx, seen)
            tracer.counters.calls.append(
                LayerTrace(self.layer, int(np.prod(idx.shape[:-1])), len(experts), waves, in_ring)
            )
            tracer.counters.unique_experts += len(experts)
        return y

    def _observe(self, idx: np.ndarray) -> _Seen:
        """Count this call's routing (popularity, test hooks, the archive) and work out,
        from the router's full ranking, the hints and gate-echo bets to place after it."""
        tracer = self._tracer
        flat = idx.reshape(-1, idx.shape[-1])  # [T, k]
        if tracer.observers.popularity is not None:
            tracer.observers.popularity.add(self.layer, flat)
        if tracer.observers.on_routing is not None:
            tracer.observers.on_routing(self.layer, flat)
        gates = tracer.step.gates.pop(self.layer, None)
        g = None  # router logits [T, E], float32, on the host
        if gates is not None:
            g = np.array(gates.astype(mx.float32)).reshape(flat.shape[0], -1)
        record = tracer.observers.recorder.depth if tracer.observers.recorder is not None else 0
        hint = tracer.hint_depth if tracer.observers.hint is not None else 0
        ranking = None
        if g is not None and max(record, hint) > 0:
            ranking = gate_ranking(g, flat, max(record, hint))
        if tracer.observers.recorder is not None:
            if self.layer == tracer.first_layer:
                tracer.observers.recorder.begin(flat.shape[0], tracer.step.phase)
            if ranking is not None:
                tracer.observers.recorder.record(self.layer, ranking[:, :record])
        seen = _Seen()
        if ranking is not None and hint:
            seen.hints = runner_ups(ranking, flat.shape[-1], hint)
        if tracer.spec and tracer.step.phase == 1 and g is not None and flat.shape[0] == 1:
            seen.bets = (g, flat)  # placed after this layer's own demand has been served
        return seen

    def _after(self, tracer: Tracer, x: mx.array, idx: np.ndarray, seen: _Seen) -> None:
        """Once this layer's own experts are served: hints, gate-echo bets, lookahead."""
        if seen.hints and tracer.observers.hint is not None:
            tracer.observers.hint(self.layer, seen.hints)  # after this request, before the next one
        if seen.bets is not None:
            self._bet_on_next_token(*seen.bets, tracer.spec)
        looking = tracer.lookahead and tracer.step.phase == 1
        if looking or tracer.observers.recorder is not None:
            self._look_ahead(x, idx, prefetch=looking)

    def _run(
        self, x: mx.array, idx: np.ndarray, experts: list[int], sort: bool = False
    ) -> mx.array:
        slots = self._source.acquire(self.layer, experts)
        try:
            return self._compute(x, idx, experts, slots, sort)
        finally:
            self._source.release(slots)

    def _look_ahead(self, x: mx.array, idx: np.ndarray, prefetch: bool = True) -> None:
        """Score this token's experts against the prediction made one layer earlier, then
        run the next MoE layer's router on this layer's input and queue its top-k as
        speculative reads (an approximation: the next layer's true input is not known).
        A routing archive being recorded gets that ranking (``record_ahead``), also when
        nothing is prefetched (``prefetch`` False: prefill, or lookahead off)."""
        tracer = self._tracer
        k = idx.shape[-1]
        guess = tracer.step.predicted.pop(self.layer, None)
        if guess is not None:
            used = set(idx.reshape(-1).tolist())
            tracer.counters.lookahead_hits += len(guess & used)
            tracer.counters.lookahead_total += len(used)
        nxt = tracer.next_layer.get(self.layer)
        if nxt is None or nxt not in tracer.routers:
            return
        out = tracer.routers[nxt](x)
        if isinstance(out, tuple):  # a router that selects itself: (indices, scores)
            ranked = np.array(out[0]).reshape(-1, k)  # [B, k], its own order
        else:
            logits = np.array(out.astype(mx.float32))
            logits = logits.reshape(-1, logits.shape[-1])  # [B, E]
            depth = max(
                k, tracer.observers.recorder.depth if tracer.observers.recorder is not None else k
            )
            ranked = np.argsort(-logits, axis=-1, kind="stable")[:, :depth]  # [B, depth]
        if tracer.observers.recorder is not None:
            tracer.observers.recorder.record_ahead(nxt, ranked)
        if not prefetch:
            return
        top = np.unique(ranked[:, :k]).tolist()  # a batched step: the union of the rows' guesses
        tracer.step.predicted[nxt] = set(top)
        self._source.prefetch(nxt, top)

    def _bet_on_next_token(self, gates: np.ndarray, used: np.ndarray, n: int) -> None:
        """Gate echo: queue this token's gate ranks k..k+n-1 at this layer as speculative
        reads for the next token (adjacent tokens share experts). The first MoE layer of a
        step first drops the previous token's bets that have not started."""
        if self.layer == self._tracer.first_layer:
            self._source.cancel_speculative()
        k = used.shape[-1]
        ranking = gate_ranking(gates, used, k + n)[0, k:]
        self._source.prefetch(self.layer, ranking.tolist())

    def _run_whole(self, x: mx.array, idx: np.ndarray, experts: list[int]) -> tuple[mx.array, int]:
        """Wait for every expert of the layer, then compute them in one call."""
        lease = self._source.reserve(self.layer, experts)
        try:
            resident = int(sum(lease.ready))
            lease.wait()
            return self._compute(x, idx, experts, lease.slots), resident
        finally:
            lease.release()  # the one release, also when a read failed

    def _run_overlapped(
        self, x: mx.array, idx: np.ndarray, experts: list[int]
    ) -> tuple[mx.array, int]:
        """Compute each expert as soon as its slot is READY: the resident ones at once,
        the misses in the order their reads complete. Returns the output and how many
        experts were resident."""
        lease = self._source.reserve(self.layer, experts)
        try:
            resident = int(sum(lease.ready))
            if resident == len(experts):
                return self._compute(x, idx, experts, lease.slots), resident
            parts = _Parts(x, idx)
            pending = list(range(len(experts)))
            ready = [i for i in pending if lease.ready[i]]
            while pending:
                if not ready:
                    ready = lease.wait_any(pending)
                pending = [i for i in pending if i not in ready]
                part = [experts[i] for i in ready]
                slots = [lease.slots[i] for i in ready]
                parts.add(
                    part, lambda px, pi, p=part, s=slots: self._compute(px, pi, p, s, parts.sorted)
                )
                ready = []
            return parts.result(), resident
        finally:
            lease.release()  # the one release, also when a read failed

    def _compute(
        self,
        x: mx.array,
        idx: np.ndarray,
        experts: list[int],
        slots: list[int],
        sort: bool = False,
    ) -> mx.array:
        """mlx-lm's expert computation on ring slots; evaluated before returning.

        x: [..., D]; idx: [..., k] expert ids, each in ``experts``, whose slots are
        ``slots``. One call when the slots share a bank (as mlx-lm's call, ids remapped
        to slots); else each (token, rank) pair is computed in its expert's bank. ``sort``:
        this is a part of a call mlx-lm makes with its rows sorted by expert (64 or more),
        so the part is computed the same way whatever its size (``switch_call``)."""
        located = [self._locate(s) for s in slots]
        banks = sorted({b for b, _ in located})
        if len(banks) == 1:
            table = np.zeros(self.num_experts, dtype=np.uint32)
            table[experts] = [local for _, local in located]
            y = switch_call(self._inners[banks[0]], x, mx.array(table[idx]), sort)
            mx.eval(y)  # the matmuls must be done reading the slots before they are released
            return y
        parts = _Parts(x, idx)
        sort = sort or parts.sorted
        for bank in banks:
            mine = [i for i, (b, _) in enumerate(located) if b == bank]
            part = [experts[i] for i in mine]
            slots_b = [slots[i] for i in mine]
            parts.add(part, lambda px, pi, p=part, s=slots_b: self._compute(px, pi, p, s, sort))
        return parts.result()

    def _run_in_waves(
        self, x: mx.array, idx: np.ndarray, experts: list[int], capacity: int
    ) -> tuple[mx.array, int]:
        """The union does not fit the ring: run it in waves of at most ``capacity`` experts.

        Each wave computes exactly the (token, rank) pairs routed to its experts, one row
        per pair; the outputs are put back at their (token, rank) position, so the block's
        rank-order combination, and the total work, are those of a single pass.
        """
        parts = _Parts(x, idx)
        waves = 0
        for start in range(0, len(experts), capacity):
            wave = experts[start : start + capacity]
            parts.add(wave, lambda px, pi, w=wave: self._run(px, pi, w, parts.sorted))
            waves += 1
        return parts.result(), waves


class _Parts:
    """Assembles a MoE call's output [..., k, D] from parts computed separately, each on
    the (token, rank) pairs routed to some of the experts, one row per pair. Each pair's
    row is put back at its (token, rank) position, so the block's rank-order combination
    is the single call's."""

    def __init__(self, x: mx.array, idx: np.ndarray) -> None:
        # N = tokens, k = ranks, D = hidden, P = (token, rank) pairs of one part
        self.sorted = idx.size >= SORT_FROM  # mlx-lm would make this call sorted
        self.shape = idx.shape
        self.k = idx.shape[-1]
        self.flat_idx = idx.reshape(-1, self.k)  # [N, k]
        self.flat_x = x.reshape(-1, x.shape[-1])  # [N, D]
        self.out: mx.array | None = None

    def add(self, experts: list[int], compute: Callable[[mx.array, np.ndarray], mx.array]) -> None:
        """``compute(x [P, D], idx [P, 1])`` -> [P, 1, D] for the pairs routed to ``experts``."""
        rows, ranks = np.nonzero(np.isin(self.flat_idx, experts))  # [P], [P]
        y = compute(self.flat_x[mx.array(rows)], self.flat_idx[rows, ranks][:, None])
        if self.out is None:
            self.out = mx.zeros((self.flat_idx.shape[0], self.k, y.shape[-1]), dtype=y.dtype)
        self.out[mx.array(rows), mx.array(ranks)] = y[:, 0]
        mx.eval(self.out)

    def result(self) -> mx.array:
        assert self.out is not None
        return self.out.reshape(*self.shape, self.out.shape[-1])


def ring_modules(original: nn.Module, banks: list[dict[str, Any]]) -> list[nn.Module]:
    """One copy of ``original`` (a SwitchGLU/SwitchMLP, quantized as the vault is) per
    bank, with each stacked parameter replaced by that bank's array of the same component
    name. The copies share everything else (activation, settings)."""
    from mlx.utils import tree_flatten, tree_unflatten

    names = {name for name, _ in tree_flatten(original.parameters())}
    missing = names - set(banks[0])
    extra = set(banks[0]) - names
    if missing or extra:
        raise VaultError(
            f"vault record components {sorted(banks[0])} do not match the model's expert "
            f"parameters {sorted(names)}; convert the model again with this S-MoE"
        )
    modules = []
    for i, arrays in enumerate(banks):
        module = original if i == 0 else _clone(original)
        module.update(tree_unflatten(list(arrays.items())))
        modules.append(module)
    return modules


def _clone(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s structure: child modules copied, arrays shared."""
    twin = copy.copy(module)
    for name, child in module.children().items():
        if isinstance(child, nn.Module):
            twin[name] = _clone(child)
    return twin


# mlx-lm's SwitchGLU/SwitchMLP sort their rows by expert from this many (token, rank) pairs.
SORT_FROM = 64


def switch_call(module: nn.Module, x: mx.array, indices: mx.array, sort: bool) -> mx.array:
    """``module(x, indices)``, or with ``sort`` the same computation with its rows sorted
    by expert even when there are fewer than SORT_FROM of them.

    A part of a call that mlx-lm makes sorted (a wave, the experts of one bank, those
    already resident) is then computed by the same kernels as in mlx-lm's call: on CUDA,
    sorted and unsorted calls use different kernels (a grouped GEMM, a matrix-vector
    product), whose rows round differently. The sorted path below is mlx-lm's own
    (switch_layers.SwitchGLU/SwitchMLP.__call__ with do_sort forced), for those two classes.
    """
    from mlx_lm.models import switch_layers as sl

    if not sort or indices.size >= SORT_FROM:
        return module(x, indices)  # mlx-lm decides: the same choice it makes in memory
    if not isinstance(module, sl.SwitchGLU | sl.SwitchMLP):
        return module(x, indices)
    x = mx.expand_dims(x, (-2, -3))
    indices = mx.stop_gradient(indices)
    x, idx, inv_order = sl._gather_sort(x, indices)
    if isinstance(module, sl.SwitchGLU):
        x_up = module.up_proj(x, idx, sorted_indices=True)
        x_gate = module.gate_proj(x, idx, sorted_indices=True)
        x = module.down_proj(module.activation(x_up, x_gate), idx, sorted_indices=True)
    else:
        x = module.fc2(
            module.activation(module.fc1(x, idx, sorted_indices=True)), idx, sorted_indices=True
        )
    return sl._scatter_unsort(x, inv_order, indices.shape).squeeze(-2)
