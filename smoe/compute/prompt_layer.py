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
from typing import Any

import mlx.core as mx
import numpy as np

from smoe.compute.solo_rows import reference_rows_of
from smoe.compute.switch import CallAssembly
from smoe.compute.tracing import LayerTrace, WaveTime


class PromptLayerServing:
    """``serve_prompt_layer`` for StreamingExperts (which provides ``layer``, ``_source``,
    ``_tracer`` and ``_compute``)."""

    layer: int
    _source: Any
    _tracer: Any
    _compute: Any

    def serve_prompt_layer(self, calls: list[tuple[mx.array, np.ndarray]]) -> list[mx.array]:
        """This layer for every chunk of a prompt, in prompt order.

        calls: (x [..., D], idx [..., k] expert ids on the host) per chunk; returns each
        chunk's output [..., k, D], evaluated. Read errors are raised after every slot
        pinned here has been released."""
        start, waited = time.perf_counter(), self._source.wait_seconds
        idxs = [idx for _, idx in calls]
        experts = np.unique(np.concatenate([i.reshape(-1) for i in idxs])).tolist()
        capacity = self._source.capacity()
        refs = [reference_rows_of(idx.size, idx.shape[-1]) for idx in idxs]
        wave_times: list[WaveTime] = []
        if len(experts) <= capacity:
            ys, in_ring = self._serve_whole(calls, experts, refs)
        else:
            ys, wave_times = self._serve_in_waves(calls, experts, capacity, refs)
            in_ring = 0
        if self._tracer is not None:
            trace = LayerTrace(
                self.layer,
                sum(int(np.prod(idx.shape[:-1])) for idx in idxs),
                len(experts),
                max(1, len(wave_times)),
                in_ring,
                phase=0,
                wait_s=self._source.wait_seconds - waited,
                seconds=time.perf_counter() - start,
                wave_times=wave_times,
            )
            self._tracer.counters.calls.append(trace)
            self._tracer.counters.unique_experts += len(experts)
        return ys

    def _serve_whole(
        self, calls: list[tuple[mx.array, np.ndarray]], experts: list[int], refs: list[int]
    ) -> tuple[list[mx.array], int]:
        """The union fits the ring: pin it, wait for it, compute each chunk's call."""
        lease = self._source.reserve(self.layer, experts)
        try:
            in_ring = int(sum(lease.ready))
            lease.wait()
            slot_of = dict(zip(experts, lease.slots, strict=True))
            ys = []
            for (x, idx), ref in zip(calls, refs, strict=True):
                mine = np.unique(idx).tolist()
                ys.append(self._compute(x, idx, mine, [slot_of[e] for e in mine], ref))
            return ys, in_ring
        finally:
            lease.release()  # the one release, also when a read failed

    def _serve_in_waves(
        self,
        calls: list[tuple[mx.array, np.ndarray]],
        experts: list[int],
        capacity: int,
        refs: list[int],
    ) -> tuple[list[mx.array], list[WaveTime]]:
        """The union exceeds the ring: waves of ``capacity`` experts, each serving every
        chunk's rows routed to it."""
        parts = [CallAssembly(x, idx) for x, idx in calls]
        times: list[WaveTime] = []
        for first in range(0, len(experts), capacity):
            wave = experts[first : first + capacity]
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
                times.append(WaveTime(len(wave), ready - asked, time.perf_counter() - ready))
            finally:
                self._source.release(slots)
        return [part.result() for part in parts], times
