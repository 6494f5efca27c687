"""A streamed MoE layer served for every chunk of a prompt at once (smoe.compute.prompt_pass).

``PromptLayerServing`` is part of ``StreamingExperts`` (a mixin: the same object, its
ring access and expert computation), kept apart because it is the one place a layer's
work spans several model calls: the union of the chunks' experts is read once, and each
chunk's output is computed as its own call would be (``_compute`` on the chunk's rows,
with its call's reference rows and sort choice), so its bits are those of chunk-by-chunk
prefill. A union larger than the ring runs in waves of the ring's capacity, each expert
read once and applied to every chunk's rows routed to it, put back at their (token, rank)
positions (``CallAssembly``), as one chunk's waves are.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Generator
from typing import Any

import mlx.core as mx
import numpy as np

from smoe.compute.solo_rows import reference_rows_of
from smoe.compute.switch import CallAssembly
from smoe.compute.tracing import LayerTrace, WaveTime

# A pass keeps at most all but 1/ROOM_SHARE of the ring for one layer: room for other
# requests' steps between its steps (a decode step of one sequence at a quarter ring
# of an 18-layer Qwen3-30B: 8 experts x 18 layers = a quarter of 576 slots).
ROOM_SHARE = 4


class PromptLayerServing:
    """``prompt_layer_steps`` for StreamingExperts (which provides ``layer``, ``_source``,
    ``_tracer`` and ``_compute``)."""

    layer: int
    _source: Any
    _tracer: Any
    _compute: Any

    def prompt_layer_steps(
        self, calls: list[tuple[mx.array, np.ndarray]]
    ) -> Generator[float, None, list[mx.array]]:
        """This layer for every chunk of a prompt, in prompt order, in steps: each ``yield``
        follows a step and gives its work in chunks' expert calls (the caller may run
        other work there: nothing is pinned). Where the union fits the ring (less the
        room left to others), the first step pins and reads all of it and computes the
        first chunk, and each later step one more chunk on its experts, pinned again (still
        in the ring unless other work evicted them meanwhile); else the union runs in
        waves of that size, each read once, and a step computes one wave for a group of
        chunks worth about one chunk's expert work (the wave pinned again each step).

        calls: (x [..., D], idx [..., k] expert ids on the host) per chunk; returns each
        chunk's output [..., k, D], evaluated. Read errors are raised after every slot
        pinned here has been released. A quarter of the ring (``ROOM_SHARE``) is left to
        the steps of other requests that run between this pass's steps."""
        start, waited = time.perf_counter(), self._source.wait_seconds
        idxs = [idx for _, idx in calls]
        experts = np.unique(np.concatenate([i.reshape(-1) for i in idxs])).tolist()
        # What this pass may keep in the ring: the rest is other requests' room between
        # its steps, so that their steps do not evict what its next step needs.
        capacity = self._source.capacity()
        held = capacity - capacity // ROOM_SHARE if capacity >= 2 * ROOM_SHARE else capacity
        refs = [reference_rows_of(idx.size, idx.shape[-1]) for idx in idxs]
        wave_times: list[WaveTime] = []
        in_ring, waves = 0, 1
        if len(experts) <= held:
            ys: list[mx.array] = []
            for i, ((x, idx), ref) in enumerate(zip(calls, refs, strict=True)):
                wanted = experts if i == 0 else np.unique(idx).tolist()
                lease = self._source.reserve(self.layer, wanted)
                try:
                    if i == 0:
                        in_ring = int(sum(lease.ready))
                    lease.wait()
                    slot_of = dict(zip(wanted, lease.slots, strict=True))
                    mine = np.unique(idx).tolist()
                    ys.append(self._compute(x, idx, mine, [slot_of[e] for e in mine], ref))
                finally:
                    lease.release()  # the one release, also when a read failed
                yield 1.0
        else:
            # Waves of ``held`` experts, each read once; a step computes a wave for a
            # group of chunks worth about one chunk's expert work, then releases it.
            parts = [CallAssembly(x, idx) for x, idx in calls]
            firsts = range(0, len(experts), held)
            waves = len(firsts)
            for first in firsts:
                wave = experts[first : first + held]
                share = len(wave) / len(experts)  # of each chunk's expert work
                group = max(1, round(1 / share))
                for a in range(0, len(calls), group):
                    b = min(len(calls), a + group)
                    wave_times.append(self._wave(calls[a:b], parts[a:b], refs[a:b], wave))
                    yield (b - a) * share
            ys = [part.result() for part in parts]
        if self._tracer is not None:
            trace = LayerTrace(
                self.layer,
                sum(int(np.prod(idx.shape[:-1])) for idx in idxs),
                len(experts),
                waves,
                in_ring,
                phase=0,
                wait_s=self._source.wait_seconds - waited,
                seconds=time.perf_counter() - start,
                wave_times=wave_times,
            )
            self._tracer.counters.calls.append(trace)
            self._tracer.counters.unique_experts += len(experts)
        return ys

    def _wave(
        self,
        calls: list[tuple[mx.array, np.ndarray]],
        parts: list[CallAssembly],
        refs: list[int],
        wave: list[int],
    ) -> WaveTime:
        """One wave: pin ``wave``, compute every chunk's rows routed to it, release."""
        asked = time.perf_counter()
        slots = self._source.acquire(self.layer, wave)
        try:
            ready = time.perf_counter()
            slot_of = dict(zip(wave, slots, strict=True))
            for part, (_, idx), ref in zip(parts, calls, refs, strict=True):
                mine = [e for e in np.unique(idx).tolist() if e in slot_of]
                if mine:
                    compute = functools.partial(
                        self._compute,
                        experts=mine,
                        slots=[slot_of[e] for e in mine],
                        ref=ref,
                        sort=part.sorted,
                    )
                    part.add(mine, compute)  # evaluated: done before the release
            return WaveTime(len(wave), ready - asked, time.perf_counter() - ready)
        finally:
            self._source.release(slots)
