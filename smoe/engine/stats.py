"""``Engine.stats()``: one typed record of what the engine is doing, for every surface (the
CLI's summary, the REPL's /stats and status bar, the server's /v1/smoe/stats and
/metrics), so none of them reads the scheduler, the ring or the batcher by hand."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from smoe.errors import SmoeError
from smoe.sched.stats import SchedulerStats
from smoe.sched.types import Priority

if TYPE_CHECKING:
    from smoe.compute.runner import Runner
    from smoe.compute.tracing import Tracer
    from smoe.compute.worker import ComputeThread, LoopSlots
    from smoe.engine.batcher import Batcher
    from smoe.engine.build import EngineParts
    from smoe.io.host_tier import HostTier
    from smoe.io.reader import RecordReader
    from smoe.io.ring import ExpertRing
    from smoe.sched.popularity import Popularity
    from smoe.sched.scheduler import ExpertScheduler


@dataclass(frozen=True)
class RingStats:
    slots: int  # expert slots of the ring
    filled: int  # slots holding an expert (or being read)
    slot_bytes: int  # memory per slot: the figure inspect and plan print
    nbytes: int  # the ring's memory in all


@dataclass(frozen=True)
class HostTierStats:
    images: int  # experts the host tier can keep (0: no tier)
    held: int  # experts it keeps now (copies of the ring's included)
    image_bytes: int  # host memory per image
    hits: int  # ring misses copied up from it (bus, host -> device)
    demoted: int  # ring evictions copied down into it (bus, device -> host)
    kept: int  # ring evictions whose copy it kept already (nothing moved)
    dropped: int  # images given up for another expert

    @property
    def bytes_up(self) -> int:
        return self.hits * self.image_bytes

    @property
    def bytes_down(self) -> int:
        return self.demoted * self.image_bytes


NO_HOST_TIER = HostTierStats(0, 0, 0, 0, 0, 0, 0)


@dataclass(frozen=True)
class QueueStats:
    demand: int  # reads waiting, taken first
    speculative: int  # lookahead reads waiting
    in_flight: int  # reads the I/O threads are doing


@dataclass(frozen=True)
class BatchStats:
    active: int  # sequences being decoded
    waiting: int  # requests not yet admitted
    max_batch: int
    steps: int  # batched decode passes run
    mean_rows_per_step: float


@dataclass(frozen=True)
class EngineStats:
    """A snapshot: counters since the engine opened, gauges as they are now."""

    scheduler: SchedulerStats  # hits, misses, bytes read, queue waits, read latencies
    ring: RingStats
    host_tier: HostTierStats
    queues: QueueStats
    batch: BatchStats
    compute_dtype: str  # e.g. "float32"
    compute_dtype_note: str  # the dtype and why (smoe.compute.model.compute_dtype_note)
    arithmetic: str  # whose kernels run the matmuls (smoe.compute.native.arithmetic)
    direct_io: bool  # reads bypass the page cache
    draft: dict[str, Any] | None  # drafted decoding's passes and acceptance, when on
    # Decode steps built ahead, medians by rows: build, queue, wait, period, and the event
    # loop's share (smoe.compute.timeline.StepTimeline.summary).
    steps: dict[str, Any]
    # Expert uses served from the resident tables once the ring holds the whole model: they
    # ask the scheduler nothing, so ``scheduler.hits`` leaves them out
    resident_hits: int = 0

    @property
    def hits(self) -> int:
        """Expert uses found in the ring, the resident tables' included."""
        return self.scheduler.hits + self.resident_hits

    @property
    def hit_rate(self) -> float:
        """Share of expert uses found in the ring since open (as a request's own)."""
        asked = self.hits + self.scheduler.misses
        return self.hits / asked if asked else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "scheduler": self.scheduler.to_json(),
            "hits": self.hits,
            "resident_hits": self.resident_hits,
            "hit_rate": self.hit_rate,
            "ring": self.ring.__dict__.copy(),
            "host_tier": self.host_tier.__dict__
            | {"bytes_up": self.host_tier.bytes_up, "bytes_down": self.host_tier.bytes_down},
            "queues": self.queues.__dict__.copy(),
            "batch": self.batch.__dict__.copy(),
            "compute_dtype": self.compute_dtype,
            "compute_dtype_note": self.compute_dtype_note,
            "arithmetic": self.arithmetic,
            "direct_io": self.direct_io,
            "draft": self.draft,
            "steps": self.steps,
        }


@dataclass(frozen=True)
class EngineInternals:
    """``Engine.debug``: the engine's parts, the one door to them: for the engine's own
    modules (``parts()``), and for tests and benchmarks that must drive or inspect one
    directly (a forced ordering, an invariant check, a fault injected). Not a stable API:
    what a user needs is on Engine itself and in ``Engine.stats()``. A field is None
    before the engine opens and after it closes."""

    scheduler: ExpertScheduler | None  # event loop only
    runner: Runner | None  # compute thread only
    ring: ExpertRing | None
    batcher: Batcher | None
    reader: RecordReader | None
    host_tier: HostTier | None  # None also where the engine has no host tier
    compute: ComputeThread | None  # run(fn, *args) on the compute thread
    tracer: Tracer
    popularity: Popularity | None
    slots: LoopSlots | None
    open_parts: EngineParts | None

    def parts(self) -> EngineParts:
        """Every part, typed; SmoeError if the engine is not open."""
        if self.open_parts is None:
            raise SmoeError("the engine is not open: use 'async with Engine.open(...) as engine'")
        return self.open_parts

    @classmethod
    def of(cls, parts: EngineParts | None, tracer: Tracer) -> EngineInternals:
        if parts is None:
            return cls(None, None, None, None, None, None, None, tracer, None, None, None)
        p = parts
        return cls(
            p.scheduler, p.runner, p.ring, p.batcher, p.reader, p.host_tier, p.compute,
            tracer, p.popularity, p.slots, p,
        )  # fmt: skip


def engine_stats(parts: EngineParts, dtype: str, dtype_note: str, arithmetic: str) -> EngineStats:
    """``Engine.stats()`` from the open engine's parts (no device work)."""
    from smoe.io.ring import slot_size

    sched, batcher, runner = parts.scheduler, parts.batcher, parts.runner
    return EngineStats(
        scheduler=sched.stats,
        ring=RingStats(sched.num_slots, sched.fill(), slot_size(parts.ring), parts.ring.nbytes),
        host_tier=_host_tier_stats(parts.host_tier),
        queues=QueueStats(
            sched.queue_depth(Priority.DEMAND),
            sched.queue_depth(Priority.SPECULATIVE),
            sched.in_flight,
        ),
        batch=BatchStats(
            len(batcher.active),
            batcher.queued,
            batcher.max_batch,
            batcher.steps,
            batcher.step_rows / batcher.steps if batcher.steps else 0.0,
        ),
        compute_dtype=dtype,
        compute_dtype_note=dtype_note,
        arithmetic=arithmetic,
        direct_io=parts.reader.direct,
        draft=runner.drafting.stats.to_json() if runner.drafting is not None else None,
        steps=runner.timeline.summary(),
        resident_hits=parts.slots.resident_hits,
    )


def _host_tier_stats(tier: HostTier | None) -> HostTierStats:
    if tier is None:
        return NO_HOST_TIER
    return HostTierStats(
        tier.capacity,
        tier.records(),
        tier.image_bytes,
        tier.hits,
        tier.demoted,
        tier.kept,
        tier.dropped,
    )
