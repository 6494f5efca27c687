"""An engine's parts, opened in order on one exit stack (``open_parts``).

The parts, in the order they start: the compute thread, this rank's place among the
ranks (expert parallelism only), the ring, the I/O reader, the popularity counts, the
scheduler, the loop's slot source, the model and its runner, the tokenizer, the batcher.
Each part's way down is pushed on the caller's ``AsyncExitStack`` as soon as the part
exists, so a failure halfway closes exactly what was started and ``Engine.aclose`` is
the stack's unwinding. The unwinding order is the reverse of the pushes below; where a
part must stop before one made earlier (the compute thread before the ring it computes
on), a later push says so. On a normal close: the batcher, the compute thread, the ring,
the scheduler, the reader's threads, the watchdog, the popularity counts saved.

Thread rules: ``open_parts`` runs on the event loop; it runs MLX work (the ring, the
model) on the compute thread it starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import anyio

from smoe.compute.draft import Drafting
from smoe.compute.runner import Runner
from smoe.compute.tracing import Tracer
from smoe.compute.worker import ComputeThread, LoopSlots
from smoe.engine.batcher import Batcher, Meter
from smoe.engine.ranks import Ranks
from smoe.engine.tokenizer import load_tokenizer
from smoe.io.host_tier import HostTier, TieredReader
from smoe.io.open import open_reader
from smoe.io.reader import RecordReader
from smoe.io.ring import ExpertRing
from smoe.io.staged import StagedRing
from smoe.io.unified import UnifiedRing
from smoe.models.registry import layer_major_prefill
from smoe.parallel.watchdog import Watchdog
from smoe.plan.budget import pass_tokens
from smoe.plan.options import EngineOptions
from smoe.plan.plan import Plan
from smoe.plan.ring import current_device
from smoe.sched.hints import split_policy_name
from smoe.sched.policy import PinnedHot
from smoe.sched.popularity import Popularity
from smoe.sched.scheduler import ExpertScheduler


@dataclasses.dataclass(frozen=True)
class EngineParts:
    """What an open engine is made of. Each part keeps its own thread rules (its module's
    docstring); ``ranks`` is None when one process computes every expert."""

    compute: ComputeThread
    ranks: Ranks | None
    ring: ExpertRing
    reader: RecordReader
    host_tier: HostTier | None  # host-memory copies between a GPU's ring and the vault
    popularity: Popularity
    scheduler: ExpertScheduler
    slots: LoopSlots
    runner: Runner
    tokenizer: Any
    batcher: Batcher


async def open_parts(
    vault: Any,
    options: EngineOptions,
    plan: Plan,
    workers: int,
    tracer: Tracer,
    lock: asyncio.Lock,
    stack: contextlib.AsyncExitStack,
) -> EngineParts:
    """Start every part for ``vault`` (a Vault, or a Source run as one) as ``plan`` says,
    with ``workers`` I/O threads; ``tracer`` is wired to the popularity counts and router
    hints, ``lock`` is the engine's one-job-at-a-time lock. Raises what a part raises
    (GroupError joining ranks, VaultError for the model's files); what started is then
    closed by ``stack``, as on a normal close."""
    compute = ComputeThread()
    stack.push_async_callback(compute.close)
    popularity = Popularity(vault)
    # Saved last, once every thread that counts into it has stopped (off the loop: it
    # waits for other processes' lock and fsyncs).
    stack.push_async_callback(anyio.to_thread.run_sync, popularity.save)
    slots_planned, ranks = plan.ring.slots, None
    if options.distributed is not None:
        watchdog = Watchdog(options.collective_timeout)
        stack.callback(watchdog.close)
        ranks = await Ranks.join(compute, vault, options.distributed, popularity.counts, watchdog)
        slots_planned = ranks.ring_slots(slots_planned)  # this rank's experts at most
    ring = await compute.run(
        make_ring, vault, options, plan, workers, plan.ring.kind, slots_planned
    )
    reader = open_reader(
        vault, ring, workers=workers, direct=options.direct_io, parts=options.read_parts
    )
    stack.push_async_callback(anyio.to_thread.run_sync, reader.close)  # joins its threads
    tier = None
    if plan.host_tier.images and isinstance(ring, StagedRing) and ranks is None:
        discrete = plan.device.discrete
        tier = await compute.run(HostTier, ring, plan.host_tier.images, discrete)
        stack.callback(tier.close)  # (after the ring's close, pushed below)
    scheduler = make_scheduler(vault, options, ring, reader, popularity, workers, tier)
    stack.push_async_callback(scheduler.close)
    # The ring closes before the scheduler and the reader: a read waiting for a landing
    # buffer (freed only by commits, which have stopped) gives up.
    stack.callback(ring.close)
    # ... and after the compute thread, which commits into the ring and computes on it:
    # the step in progress and every queued job finish first.
    stack.push_async_callback(compute.close)
    tracer.observers.popularity = popularity
    loop = asyncio.get_running_loop()
    slots = wire_to_loop(vault, options, tracer, scheduler, ring, compute, loop, ranks)
    runner = await compute.run(build_runner, vault, options, plan, ring, slots, tracer, ranks)
    tokenizer = await compute.run(_load_tokenizer, vault)
    batcher = Batcher(
        compute,
        runner,
        lock,
        make_meter(scheduler, slots, tracer, ring, tier),
        max_batch=plan.max_batch,
        on_demand=functools.partial(_give_way, scheduler),
        draft=runner.step_draft if runner.drafting is not None else None,
        timeline=runner.timeline,
    )
    stack.push_async_callback(batcher.close)  # the way down starts here: no new step
    return EngineParts(
        compute,
        ranks,
        ring,
        reader,
        tier,
        popularity,
        scheduler,
        slots,
        runner,
        tokenizer,
        batcher,
    )


def make_meter(
    scheduler: ExpertScheduler,
    slots: LoopSlots,
    tracer: Tracer,
    ring: ExpertRing,
    tier: HostTier | None = None,
) -> Callable[[], Meter]:
    """The batcher's meter: engine-wide counters read around each job."""

    def meter() -> Meter:
        sched = scheduler.stats
        bus = tier.hits * tier.image_bytes if tier is not None else 0
        return Meter(
            sched.bytes_read(),
            sched.hits + slots.resident_hits,
            sched.misses,
            slots.wait_seconds,
            tracer.counters.unique_experts,
            getattr(ring, "commit_seconds", 0.0),
            bus,
        )

    return meter


def make_ring(
    vault: Any, options: EngineOptions, plan: Plan, workers: int, kind: str, slots: int
) -> ExpertRing:
    """The ring (on the compute thread: its arrays belong to that thread's device)."""
    import mlx.core as mx

    mx.set_default_device(plan.mlx_device)
    layout = vault.manifest.record
    if kind == "unified":
        return UnifiedRing(layout, slots)
    return StagedRing.for_vault(
        vault.manifest,
        slots,
        plan.dtype,
        workers=workers,
        gpu=plan.mlx_device == mx.gpu,
        discrete=current_device(plan.mlx_device).discrete,
        max_bank_bytes=options.bank_bytes,
    )


def make_scheduler(
    vault: Any,
    options: EngineOptions,
    ring: ExpertRing,
    reader: RecordReader,
    popularity: Popularity,
    workers: int,
    tier: HostTier | None = None,
) -> ExpertScheduler:
    """The scheduler over ``ring``, reading through ``reader``, under the options' policy;
    with a host tier, through it first, and demoting what the ring evicts into it."""
    m = vault.manifest
    base, _ = split_policy_name(options.policy)
    policy: Any = base
    if base == "hot":  # pin the historically hottest half of the ring
        policy = PinnedHot.from_counts(popularity.as_mapping(), ring.num_slots // 2)
    backend: Any = reader
    on_evict = None
    if tier is not None:
        backend = TieredReader(tier, reader)

        def on_evict(key: tuple[int, int], slot: int) -> None:
            tier.demote(m.record_index(*key), slot)

    scheduler = ExpertScheduler(
        ring.num_slots,
        backend,
        record_of=lambda k: m.record_index(*k),
        record_bytes=m.record.stride,
        workers=workers,
        runway=workers,  # each worker finds its next read queued (docs/architecture.md)
        policy=policy,
        # A ring holding every expert keeps each at its record's index: a layer's
        # experts stay in one bank (one call), as mlx-lm holds them.
        home=(lambda k: m.record_index(*k)) if ring.num_slots >= m.num_records else None,
        on_evict=on_evict,
    )
    weight_of = getattr(scheduler.policy, "weight_of", None)
    if tier is not None and weight_of is not None:  # one frequency book for both tiers
        keys = {
            m.record_index(spec.layer, e): (spec.layer, e)
            for spec in m.layers
            for e in range(m.num_experts)
        }
        tier.weight = lambda record: weight_of(keys[record])
    return scheduler


def wire_to_loop(
    vault: Any,
    options: EngineOptions,
    tracer: Tracer,
    scheduler: ExpertScheduler,
    ring: ExpertRing,
    compute: ComputeThread,
    loop: asyncio.AbstractEventLoop,
    ranks: Ranks | None,
) -> LoopSlots:
    """What the compute and I/O threads call back into the loop with: slot requests (the
    LoopSlots returned), router hints, and the staged ring's landed records."""
    m = vault.manifest
    if split_policy_name(options.policy)[1]:
        top_k = m.shape.experts_per_token
        tracer.hint_depth = options.hint_depth_for(top_k, m.num_experts)

        def hint(layer: int, experts: list[int]) -> None:  # the compute thread's call
            loop.call_soon_threadsafe(scheduler.hint, layer, experts)

        tracer.observers.hint = hint
    # A ring holding every expert serves layers from device tables; not across ranks,
    # where each layer computes this rank's experts only.
    every_key: list[tuple[int, int]] | None = [
        (spec.layer, e) for spec in m.layers for e in range(m.num_experts)
    ]
    if ranks is not None:
        every_key = None
    if isinstance(ring, StagedRing):
        committer = _CommitOnCompute(ring, compute)

        def landed() -> None:  # an I/O thread's call: commit on the loop, soon
            loop.call_soon_threadsafe(committer.soon)

        ring.on_landed = landed
    return LoopSlots(scheduler, loop, ring, every_key)


class _CommitOnCompute:
    """Has the compute thread commit landed records, even when idle: once queued, a
    commit job takes every landing that arrives before it runs. Event loop only."""

    def __init__(self, ring: StagedRing, compute: ComputeThread) -> None:
        self._ring, self._compute, self._queued = ring, compute, False

    def soon(self) -> None:
        if self._queued:
            return
        self._queued = True

        def job() -> None:
            self._queued = False
            self._ring.commit()

        try:
            self._compute.submit(job)
        except RuntimeError:  # the compute thread is shutting down
            self._queued = False


def build_runner(
    vault: Any,
    options: EngineOptions,
    plan: Plan,
    ring: ExpertRing,
    slots: LoopSlots,
    tracer: Tracer,
    ranks: Ranks | None,
) -> Runner:
    """The model over the ring and its Runner (on the compute thread)."""
    import mlx.core as mx

    from smoe.compute.cpu_split import install_row_split
    from smoe.compute.model import build_model, moe_routers
    from smoe.compute.native import Native, install_native
    from smoe.compute.rowwise import RowwiseAttention, install_rowwise_attention
    from smoe.compute.solo_rows import install_row_pieces, with_float_kernel
    from smoe.compute.speculation import RouterTap
    from smoe.compute.streaming import StreamingExperts
    from smoe.util import blas

    mx.set_default_device(plan.mlx_device)  # the compute thread's MLX work
    source, shards = (slots, None) if ranks is None else ranks.shards(slots)
    rules = plan.rules
    model = build_model(vault, ring, source, plan.dtype, tracer, shards=shards, rules=rules)
    batchable = install_rowwise_attention(model, vault.config()["model_type"])
    if rules is not None:  # after the attention wrap: a row-by-row one runs rows alone

        def skip(m: object) -> bool:
            unbatched = isinstance(m, RowwiseAttention) and not m.batched
            return unbatched or isinstance(m, StreamingExperts)

        install_row_pieces(model, skip, moe_routers(model, vault))
        rules = with_float_kernel(rules, model)
    if plan.mlx_device == mx.cpu and plan.rules is None:  # every core, MLX's bits
        if Native.here().on and options.cpu_kernels == "auto":  # ours, else MLX's by rows
            install_native(model)  # routers included (a lookahead runs its own copy)
            for block in model.modules():
                if isinstance(block, StreamingExperts):
                    for experts in block.expert_modules():
                        install_native(experts)
        else:
            floats = blas.in_use() == blas.BUNDLED
            not_routers = lambda path, parent: isinstance(parent, RouterTap)  # noqa: E731
            install_row_split(model, not_routers, floats)
    layers = len(vault.manifest.layers)
    o = options
    return Runner(
        model,
        chunk=o.prefill_chunk,
        tracer=tracer,
        batchable=batchable,
        kv_bits=o.kv_bits,
        kv_group_size=plan.kv_group_size,
        # Decode is built a step ahead only when a pass needs nothing from the host.
        resident=lambda: slots.all_resident(layers) and not tracer.needs_routing_now(),
        drafting=Drafting.named(o.draft, o.draft_tokens) if o.draft else None,
        rules=rules,
        layer_major=layer_major_prefill(vault.config()),
        pass_tokens=pass_tokens(plan.max_context, o.prefill_chunk),
    )


def _give_way(scheduler: ExpertScheduler) -> None:
    """A request arrived: pre-warm and stale bets give way to it at once."""
    scheduler.cancel_speculative()


def _load_tokenizer(vault: Any) -> Any:
    vault.verify_side_files()  # the files mlx-lm reads next, against their checksums
    eos = vault.config().get("eos_token_id")
    return load_tokenizer(vault.path, [eos] if isinstance(eos, int) else eos)
