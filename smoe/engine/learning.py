"""What an engine learns and does between requests (``Engine.learning``): pre-warm the
ring with the historically hottest experts, load every expert ahead where the ring holds
them all, warm MLX's kernels up, and record routing decisions to an archive
(smoe.telemetry.archive). Event loop only; the reads it queues are the scheduler's
speculative ones, which a real request cancels at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from smoe.compute.tracing import Tracer
from smoe.errors import SmoeError
from smoe.util.sizes import format_bytes

if TYPE_CHECKING:
    from smoe.engine.build import EngineParts
    from smoe.engine.core import Engine
    from smoe.engine.group import Group

# The token ``warm_up`` repeats (any id does; modulo the vocabulary).
WARM_UP_TOKEN = 11


class Learning:
    """Pre-warm, load-all, warm-up and the routing archive of one engine."""

    def __init__(self, engine: Engine, tracer: Tracer) -> None:
        self._engine = engine  # generate() for the warm-up; is_open, vault, group
        self._tracer = tracer

    def _parts(self) -> EngineParts:
        return self._engine.debug.parts()

    def _group(self) -> Group:
        return self._engine.group

    def prewarm(self) -> int:
        """Queue speculative reads of the historically hottest experts into EMPTY slots
        (never evicting anything); the next request drops those not yet started. Where
        the ring holds the whole model, every missing expert is queued (the hottest first):
        once all are in, they are pinned for good and decode runs as in memory, built
        ahead. Call when idle (the REPL does while waiting for input). Returns how many
        were queued; 0 once the engine is closed."""
        if not self._engine.is_open:
            return 0
        parts, group = self._parts(), self._group()
        scheduler = parts.scheduler
        free = scheduler.num_slots - scheduler.fill()
        if free <= 0:
            return 0
        keys = parts.popularity.hottest(scheduler.num_slots)
        m = self._engine.vault.manifest
        if group.whole_model and scheduler.num_slots >= m.num_records:
            hot = set(keys)
            every = [(spec.layer, e) for spec in m.layers for e in range(m.num_experts)]
            keys += [k for k in every if k not in hot]
        wanted = [k for k in keys if scheduler.slot_of(k) is None and group.owns(*k)][:free]
        by_layer: dict[int, list[int]] = {}
        for layer, expert in wanted:
            by_layer.setdefault(layer, []).append(expert)
        return sum(scheduler.prefetch(layer, e) for layer, e in by_layer.items())

    def when_idle(self, callback: Callable[[], object] | None) -> None:
        """Run ``callback`` (e.g. ``prewarm``) each time the last request leaves; None:
        nothing. Its exceptions are logged, never raised."""
        self._parts().batcher.on_idle = callback

    async def load_all(self) -> float:
        """Read every expert into a ring that holds them all, layer by layer, before any
        request: the model then runs as in memory from its first token (as mlx-lm and
        llama.cpp load a model first). Returns the seconds it took. Raises SmoeError where
        the ring holds fewer experts than the model (naming the fix) or across ranks.
        Cancelling it leaves the experts read so far in the ring."""
        scheduler = self._parts().scheduler
        m = self._engine.vault.manifest
        if not self._group().whole_model or scheduler.num_slots < m.num_records:
            need = m.num_records * self._engine.stats().ring.slot_bytes
            raise SmoeError(
                f"--preload needs a ring of every expert ({m.num_records}, "
                f"{format_bytes(need)} of them); this one holds {scheduler.num_slots}: "
                "raise --memory or leave --preload out"
            )
        start = time.perf_counter()
        every = range(m.num_experts)
        for spec in m.layers:
            scheduler.release(await scheduler.acquire(spec.layer, every))
        return time.perf_counter() - start

    async def warm_up(self, **sampling: Any) -> float:
        """Run a short throwaway generation, so that MLX compiles the kernels a reply uses
        before anyone waits for one. On a fresh machine that takes seconds: the C++
        compiler on the CPU, NVRTC on CUDA. MLX keeps the results in its own cache, so a
        later process pays less. ``sampling``: generate()'s settings that replies will use
        (temperature, top_p, ...; default greedy). Call it before serving requests. It
        reads about two tokens' experts; those reads are real and counted, but its routing
        is left out of the popularity counts that pre-warm learns from. Returns the seconds
        it took. Cancellation and errors: as ``Engine.generate``'s."""
        start = time.perf_counter()
        shape = self._engine.vault.manifest.shape
        # One token repeated: every position keeps the same hidden state (attention
        # averages equal values), so the whole prompt reads one token's experts; it is long
        # enough for the expert calls mlx-lm sorts (from 64 (token, rank) pairs).
        length = min(max(16, 64 // shape.experts_per_token + 1), self._engine.max_context - 2)
        prompt = [WARM_UP_TOKEN % shape.vocab_size] * length
        observers = self._tracer.observers
        popularity, observers.popularity = observers.popularity, None
        try:
            async for _ in self._engine.generate(
                prompt, max_tokens=2, stop_at_eos=False, **sampling
            ):
                pass
        finally:
            observers.popularity = popularity
        return time.perf_counter() - start

    def start_recording(self, depth: int = 16) -> None:
        """Record every (token, MoE layer) routing decision with its top-``depth`` gate
        ranking from now on (see smoe.telemetry.archive)."""
        from smoe.telemetry.archive import ArchiveRecorder

        m = self._engine.vault.manifest
        self._tracer.observers.recorder = ArchiveRecorder(
            m.num_experts, m.shape.experts_per_token, [s.layer for s in m.layers], depth
        )

    def stop_recording(self) -> Any:
        """Stop recording; return the RoutingArchive (None if not recording)."""
        recorder, self._tracer.observers.recorder = self._tracer.observers.recorder, None
        if recorder is None:
            return None
        m = self._engine.vault.manifest
        return recorder.archive(
            {
                "vault": str(self._engine.vault.path),
                "model_type": m.shape.model_type,
                "record_bytes": m.record.stride,
            }
        )
