"""The streaming expert module that replaces mlx-lm's SwitchGLU/SwitchMLP in each MoE layer.

mlx-lm's MoE block computes the routing (gate, top-k, scores) and calls
``self.switch_mlp(x, indices)``; we keep that block and swap only the module it calls.
Ours evaluates the routing, asks the scheduler for the chosen experts' ring slots, and
runs mlx-lm's own expert computation on the ring views with expert ids remapped to slot
ids. The block then combines the outputs exactly as it would in memory.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from smoe.compute.prompt_layer import PromptLayerServing
from smoe.compute.prompt_pass import current_chunk
from smoe.compute.sharded import ExpertShard
from smoe.compute.solo_rows import KernelRules, expert_call, reference_rows_of
from smoe.compute.speculation import (
    bet_on_next_token,
    gate_ranking,
    look_ahead,
    router_ahead,
)
from smoe.compute.switch import CallAssembly
from smoe.compute.tracing import LayerTrace, Tracer, WaveTime, current_pass
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

    @property
    def wait_seconds(self) -> float:
        """Seconds the compute thread has spent blocked on this source so far."""
        ...


@dataclass
class _Seen:
    """What one streamed call's routing asks for once its experts are served."""

    hints: list[int] = field(default_factory=list)  # experts to hint (runner-ups)
    bets: tuple[np.ndarray, np.ndarray] | None = None  # (gate logits, top-k): gate echo
    ahead: Any = None  # the next layer's router on this input (router_ahead), evaluated


class StreamingExperts(PromptLayerServing, nn.Module):  # type: ignore[misc, name-defined]
    """Drop-in for a SwitchGLU/SwitchMLP whose stacked parameters are ring arrays [S_b, ...].

    ``inners[b]`` is mlx-lm's own module (quantized like the vault) with every parameter
    replaced by bank b's array of that component, so it computes on slots in place;
    ``locate(slot)`` gives a slot's (bank, slot in bank). One bank is the common case.
    """

    def __init__(
        self,
        inners: list[Any],  # mlx-lm's SwitchGLU / SwitchMLP modules
        locate: Callable[[int], tuple[int, int]],
        layer: int,
        num_experts: int,
        source: SlotSource,
        tracer: Tracer | None = None,
        overlap: bool = True,
        shard: ExpertShard | None = None,
        rules: KernelRules | None = None,
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
        # Expert parallelism: this rank computes only its experts; the sum over ranks
        # completes the layer (compute/sharded.py). None: one process computes them all.
        object.__setattr__(self, "_shard", shard)
        # How the device's kernels treat a call's rows (smoe.compute.solo_rows): each
        # call, or part of one, is shaped to give its rows the reference call's kernel.
        # None: rows never depend on the call (the CPU).
        object.__setattr__(self, "_rules", rules)
        self.layer = layer
        self.num_experts = num_experts

    def expert_modules(self) -> list[Any]:
        """mlx-lm's expert module of each ring bank (the engine may wrap their projections
        once, before the first call: smoe.compute.native)."""
        return list(self._inners)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """Route -> reserve -> compute -> release, then tell the observers and speculate."""
        # x: [..., D]; indices: [..., k] expert ids chosen by the router (exact top-k)
        tracer = self._tracer
        if self._shard is not None:
            return self._call_sharded(x, indices)
        resident = self._source.resident_table(self.layer)
        if resident is not None and not (tracer is not None and tracer.needs_routing_now()):
            # Every expert is resident for good: no reads to schedule, so the routing
            # need not reach the host; the slot ids are gathered on the device, and
            # mlx-lm's call is the same one it makes in memory.
            if tracer is not None:
                state = current_pass()
                state.deferred.append((self.layer, indices, self._source))
                state.gates.pop(self.layer, None)  # kept for hints: none needed here
            bank, table = resident
            ref = reference_rows_of(indices.size, indices.shape[-1])
            return expert_call(self._inners[bank], x, table[indices], self._rules, ref)
        chunk = current_chunk()
        if chunk is not None:  # a chunk of a whole prompt: served with the others
            idx = np.array(indices)  # this chunk's routing, from its true hidden state
            seen = self._observe(idx) if tracer is not None else _Seen()
            y = chunk.ask(self, x, idx)
            if tracer is not None:
                self._after(tracer, x, idx, seen)
            return y
        start, waited = time.perf_counter(), self._source.wait_seconds
        ahead = self._router_ahead(tracer, x)
        if ahead is not None:
            mx.eval(indices, ahead)  # one round trip for the routing and the lookahead's
        idx = np.array(indices)  # evaluates the routing from the true hidden state
        routed = time.perf_counter()
        seen = self._observe(idx) if tracer is not None else _Seen()
        seen.ahead = ahead
        experts = np.unique(idx).tolist()
        capacity = self._source.capacity()
        ref = reference_rows_of(idx.size, idx.shape[-1])  # rows of the call judged against
        in_ring, wave_times = 0, list[WaveTime]()
        if len(experts) <= capacity:
            run = self._run_overlapped if self.overlap else self._run_whole
            y, in_ring = run(x, idx, experts, ref)
        else:
            y, wave_times = self._run_in_waves(x, idx, experts, capacity, ref)
        if tracer is not None:
            done = time.perf_counter()
            self._after(tracer, x, idx, seen)
            trace = LayerTrace(
                self.layer,
                int(np.prod(idx.shape[:-1])),
                len(experts),
                max(1, len(wave_times)),
                in_ring,
                phase=current_pass().phase,
                route_s=routed - start,
                wait_s=self._source.wait_seconds - waited,
                seconds=done - start,
                wave_times=wave_times,
            )
            tracer.counters.calls.append(trace)
            tracer.counters.unique_experts += len(experts)
        return y

    def _call_sharded(self, x: mx.array, indices: mx.array) -> mx.array:
        """This rank's experts of the call, in waves of at most the ring's capacity, the
        other ranks' (token, rank) rows left at exact zeros; then the sum over ranks.
        x: [..., D]; indices: [..., k]; returns [..., k, D] on every rank alike."""
        assert self._shard is not None
        tracer = self._tracer
        idx = np.array(indices)  # the same routing on every rank: the same hidden state
        seen = self._observe(idx) if tracer is not None else _Seen()
        mine = self._shard.mine(np.unique(idx).tolist())
        capacity = self._source.capacity()
        ref = reference_rows_of(idx.size, idx.shape[-1])
        y, waves = None, 1
        if not self.overlap and mine and len(mine) <= capacity:
            y = self._whole_share(x, idx, mine, ref)
        if y is None:
            y, wave_times = self._run_in_waves(x, idx, mine, capacity, ref)
            waves = max(1, len(wave_times))
        try:
            y = self._shard.reduce(y)
            mx.eval(y)
        except RuntimeError as e:  # the sum over ranks failed: a peer died or hung up
            raise self._shard.broken(e) from None
        if tracer is not None:
            self._after(tracer, x, idx, seen)
            tracer.counters.calls.append(
                LayerTrace(self.layer, int(np.prod(idx.shape[:-1])), len(mine), waves, 0)
            )
            tracer.counters.unique_experts += len(mine)
        return cast(mx.array, y)  # the sum over ranks: [..., k, D]

    def _whole_share(
        self, x: mx.array, idx: np.ndarray, mine: list[int], ref: int
    ) -> mx.array | None:
        """This rank's share in mlx-lm's one call of the whole layer (where the kernels'
        bits depend on the call's shape: a GPU). Other ranks' experts are computed on one
        of this rank's pinned slots and then replaced by exact zeros, so the call has the
        single machine's shape and each owned row its bits. None if this rank's experts
        span several ring banks (the caller then runs them in parts)."""
        assert self._shard is not None
        lease = self._source.reserve(self.layer, mine)
        try:
            lease.wait()
            located = [self._locate(s) for s in lease.slots]
            if len({bank for bank, _ in located}) != 1:
                return None
            table = np.full(self.num_experts, located[0][1], dtype=np.uint32)
            table[mine] = [local for _, local in located]
            y = expert_call(self._inners[located[0][0]], x, mx.array(table[idx]), self._rules, ref)
            owned = mx.array(self._shard.owned[idx])[..., None]  # [..., k, 1]
            y = mx.where(owned, y, mx.zeros_like(y))
            mx.eval(y)  # done reading the slots before they are released
            return y
        finally:
            lease.release()

    def _observe(self, idx: np.ndarray) -> _Seen:
        """Count this call's routing (popularity, test hooks, the archive) and work out,
        from the router's full ranking, the hints and gate-echo bets to place after it."""
        tracer = self._tracer
        flat = idx.reshape(-1, idx.shape[-1])  # [T, k]
        if tracer.observers.popularity is not None:
            tracer.observers.popularity.add(self.layer, flat)
        if tracer.observers.on_routing is not None:
            tracer.observers.on_routing(self.layer, flat)
        state = current_pass()
        gates = state.gates.pop(self.layer, None)
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
                state.archive_batch = tracer.observers.recorder.begin(flat.shape[0], state.phase)
            if ranking is not None:
                tracer.observers.recorder.record(
                    self.layer, ranking[:, :record], state.archive_batch
                )
        seen = _Seen()
        if ranking is not None and hint:
            seen.hints = runner_ups(ranking, flat.shape[-1], hint)
        if tracer.spec and state.phase == 1 and g is not None and flat.shape[0] == 1:
            seen.bets = (g, flat)  # placed after this layer's own demand has been served
        return seen

    def _after(self, tracer: Tracer, x: mx.array, idx: np.ndarray, seen: _Seen) -> None:
        """Once this layer's own experts are served: hints, gate-echo bets, lookahead."""
        if seen.hints and tracer.observers.hint is not None:
            tracer.observers.hint(self.layer, seen.hints)  # after this request, before the next one
        if seen.bets is not None:
            bet_on_next_token(tracer, self._source, self.layer, *seen.bets, tracer.spec)
        looking = tracer.lookahead and current_pass().phase == 1
        if looking or tracer.observers.recorder is not None:
            look_ahead(tracer, self._source, self.layer, x, idx, looking, seen.ahead)

    def _router_ahead(self, tracer: Tracer | None, x: mx.array) -> Any:
        """The lookahead's router output for ``x`` (lazy), where ``_after`` will use it."""
        if tracer is None or not (
            (tracer.lookahead and current_pass().phase == 1)
            or tracer.observers.recorder is not None
        ):
            return None
        return router_ahead(tracer, self.layer, x)

    def _run(
        self,
        x: mx.array,
        idx: np.ndarray,
        experts: list[int],
        ref: int,
        sort: bool = False,
        times: list[WaveTime] | None = None,
    ) -> mx.array:
        """One wave: pin ``experts`` once READY, compute, release (timed into ``times``)."""
        start = time.perf_counter()
        slots = self._source.acquire(self.layer, experts)
        try:
            ready = time.perf_counter()
            y = self._compute(x, idx, experts, slots, ref, sort)
            if times is not None:
                times.append(WaveTime(len(experts), ready - start, time.perf_counter() - ready))
            return y
        finally:
            self._source.release(slots)

    def _run_whole(
        self,
        x: mx.array,
        idx: np.ndarray,
        experts: list[int],
        ref: int,
    ) -> tuple[mx.array, int]:
        """Wait for every expert of the layer, then compute them in one call."""
        lease = self._source.reserve(self.layer, experts)
        try:
            resident = int(sum(lease.ready))
            lease.wait()
            return self._compute(x, idx, experts, lease.slots, ref), resident
        finally:
            lease.release()  # the one release, also when a read failed

    def _run_overlapped(
        self,
        x: mx.array,
        idx: np.ndarray,
        experts: list[int],
        ref: int,
    ) -> tuple[mx.array, int]:
        """Compute each expert as soon as its slot is READY: the resident ones at once,
        the misses in the order their reads complete. Returns the output and how many
        experts were resident."""
        lease = self._source.reserve(self.layer, experts)
        try:
            resident = int(sum(lease.ready))
            if resident == len(experts):
                return self._compute(x, idx, experts, lease.slots, ref), resident
            parts = CallAssembly(x, idx)
            pending = list(range(len(experts)))
            ready = [i for i in pending if lease.ready[i]]
            while pending:
                if not ready:
                    ready = lease.wait_any(pending)
                pending = [i for i in pending if i not in ready]
                part = [experts[i] for i in ready]
                slots = [lease.slots[i] for i in ready]
                compute = functools.partial(
                    self._compute, experts=part, slots=slots, ref=ref, sort=parts.sorted
                )
                parts.add(part, compute)
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
        ref: int,
        sort: bool = False,
        evaluate: bool = True,
    ) -> mx.array:
        """mlx-lm's expert computation on ring slots; evaluated before returning unless
        ``evaluate`` is False (a bank's part, which its caller evaluates with the rest).

        x: [..., D]; idx: [..., k] expert ids, each in ``experts``, whose slots are
        ``slots``. One call when the slots share a bank (as mlx-lm's call, ids remapped
        to slots); else each (token, rank) pair is computed in its expert's bank. ``sort``:
        this is a part of a call mlx-lm makes with its rows sorted by expert (64 or more),
        so the part is computed the same way whatever its size (``switch_call``). ``ref``:
        the (token, rank) rows of the call these rows are judged against
        (``solo_rows.expert_call``)."""
        located = [self._locate(s) for s in slots]
        banks = sorted({b for b, _ in located})
        if len(banks) == 1:
            table = np.zeros(self.num_experts, dtype=np.uint32)
            table[experts] = [local for _, local in located]
            y = expert_call(self._inners[banks[0]], x, mx.array(table[idx]), self._rules, ref, sort)
            if evaluate:  # the matmuls must be done reading the slots before they are released
                mx.eval(y)
            return y
        # Every bank's slots are held for the whole call: one evaluation of all the parts
        # (one device round trip a layer, not two a bank: measured 3.7x the expert time on
        # a GPU at a 50% ring, docs/performance.md).
        parts = CallAssembly(x, idx, evaluate=False)
        sort = sort or parts.sorted
        for bank in banks:
            mine = [i for i, (b, _) in enumerate(located) if b == bank]
            part = [experts[i] for i in mine]
            slots_b = [slots[i] for i in mine]
            compute = functools.partial(
                self._compute, experts=part, slots=slots_b, ref=ref, sort=sort, evaluate=False
            )
            parts.add(part, compute)
        y = parts.result()
        if evaluate:
            mx.eval(y)
        return y

    def _run_in_waves(
        self, x: mx.array, idx: np.ndarray, experts: list[int], capacity: int, ref: int
    ) -> tuple[mx.array, list[WaveTime]]:
        """Run ``experts`` in waves of at most ``capacity`` (the union does not fit the
        ring, or a rank computes its share of the call); return the output and each
        wave's times.

        Each wave computes exactly the (token, rank) pairs routed to its experts, one row
        per pair; the outputs are put back at their (token, rank) position, so the block's
        rank-order combination, and the total work, are those of a single pass. No
        experts (a rank that owns none of the call's): exact zeros [..., k, D].
        """
        if not experts:
            return mx.zeros((*idx.shape, x.shape[-1]), x.dtype), []
        parts = CallAssembly(x, idx)
        times: list[WaveTime] = []
        for start in range(0, len(experts), capacity):
            wave = experts[start : start + capacity]
            run = functools.partial(
                self._run, experts=wave, ref=ref, sort=parts.sorted, times=times
            )
            parts.add(wave, run)
        return parts.result(), times
