"""`smoe bench decode` / `smoe bench prefill`: where each token's time goes, against the
physical limit measured in the same run.

decode: for each budget a fresh engine (empty ring, O_DIRECT so the page cache is out of
the way) generates ``max_tokens`` greedy tokens after a short prompt (cold), then as many
after a second prompt on the ring the first left (``warm_ring``: the steady state of a
session, where the ring already holds the popular experts). Beside them, in the same
run: the raw disk bandwidth (plain O_DIRECT preadv of whole records, the engine's worker
count) and the compute time per token (decode with every expert resident: no I/O). The
physical limit for a budget is max(bytes missed per token / raw bandwidth, compute per
token): no engine can beat both the disk and the arithmetic. With host tiers
(``host_tiers``, a staged ring), each budget runs once per tier size, and the limit adds
the bytes copied up per token over the bus rate measured in the same run (copies up from
host images into slots: ``HostTier.measure_bus``); copies down go the other way. Without
``host_tiers`` no host tier runs (``host_memory=0``, where a GPU would get one by default):
these benchmarks measure the disk's path unless asked.

prefill: time to first token and prefill tok/s for prompts of several lengths at each
budget, with the bytes read against the bytes of each layer's union over the whole prompt
(reading each expert once per layer and prompt), layer-major and/or chunk by chunk.
"""

from __future__ import annotations

import random
from typing import Any

from smoe.bench.generate import budget_slots
from smoe.engine import Engine
from smoe.forecast.workload import fill_ring, random_prompt
from smoe.io.disk_probe import baseline_run, drop_file_cache
from smoe.util.sizes import parse_size
from smoe.vault.format import Vault


async def _run(
    vault: Vault,
    slots: int,
    prompt: list[int],
    max_tokens: int,
    workers: int,
    warm: bool = False,
    then: list[int] | None = None,
    **options: Any,
) -> Any:
    """One fresh engine: (stats of a generation, stats of a second one on ``then`` or None,
    the ring, whether reads were direct). ``warm``: read every expert into the ring (which
    must hold them all) and generate once first, so the measured pass does no I/O and its
    kernels are compiled. ``then``: another prompt generated after the first, on the ring
    the first left behind (the steady state of a session)."""
    async with Engine.open(vault.path, slots=slots, workers=workers, **options) as engine:
        if warm:
            await fill_ring(engine)
            async for _ in engine.generate(prompt, max_tokens=max_tokens, stop_at_eos=False):
                pass
        runs = []
        for p in [prompt] if then is None else [prompt, then]:
            stats = None
            async for ev in engine.generate(p, max_tokens=max_tokens, stop_at_eos=False):
                stats = ev.stats or stats
            runs.append(stats)
        parts = engine.debug.parts()
        return (
            runs[0],
            runs[1] if then is not None else None,
            parts.ring,
            parts.reader.direct,
            engine.stats().host_tier,
        )


async def bus_bandwidth(vault: Vault, **options: Any) -> tuple[float, int]:
    """(GB/s of copies up from host images into a staged ring's slots, the image's bytes):
    the host tier's bus (host -> GPU on CUDA), in an engine of its own."""
    from smoe.io.host_tier import image_layout

    m = vault.manifest
    count = min(32, m.num_records - 1)
    opts = options | {"ring": "staged"}
    async with Engine.open(vault.path, slots=count, host_memory=0, **opts) as probe:
        image = image_layout(m.record, probe.dtype)[1]
    async with Engine.open(vault.path, slots=count, host_memory=count * image, **opts) as engine:
        parts = engine.debug.parts()
        tier = parts.host_tier
        assert tier is not None  # (asked for: host_memory above)
        return await parts.compute.run(tier.measure_bus, tier.capacity), image


def _tier_bytes(vault: Vault, tier: str, image_bytes: int) -> int:
    """A host tier's bytes: a share of every record's image ('100%'), or a size."""
    if tier.endswith("%"):
        return round(float(tier[:-1]) / 100 * vault.manifest.num_records) * image_bytes
    return parse_size(tier)


def raw_bandwidth(vault: Vault, workers: int, records: int = 96, seed: int = 0) -> float:
    """GB/s of plain O_DIRECT preadv of whole random records (the disk's own limit)."""
    m = vault.manifest
    order = random.Random(seed).sample(range(m.num_records), min(records, m.num_records))
    drop_file_cache(vault.experts_path)
    return baseline_run(vault.experts_path, m.record.stride, order, workers).gbps


def _decode_row(
    stats: Any, compute_s: float, bandwidth: float, share: float, bus: float | None = None
) -> dict[str, Any]:
    """One ring's decode figures beside the physical limit: max(the I/O bound of its bytes
    per token at ``bandwidth`` GB/s (plus its copies up at ``bus`` GB/s, with a host
    tier), ``compute_s`` per token all resident)."""
    per_token = 1.0 / stats.decode_tok_s
    io_s = stats.decode_bytes_per_token / (bandwidth * 1e9)
    if bus:
        io_s += stats.decode_bus_bytes_per_token / (bus * 1e9)
    bound = max(io_s, compute_s)
    copy = stats.decode_copy_share * per_token
    wait = max(stats.decode_io_wait_share * per_token - copy, 0.0)  # copies happen in waits
    return {
        "ring_share_of_experts": round(share, 3),
        "decode_tok_s": round(stats.decode_tok_s, 3),
        "ttft_s": round(stats.ttft_s, 4),
        "time_per_token_s": round(per_token, 5),
        "decode_hit_rate": round(stats.decode_hit_rate, 4),
        "bytes_per_token": int(stats.decode_bytes_per_token),
        "MB_per_token": round(stats.decode_bytes_per_token / 1e6, 2),
        "bus_MB_per_token": round(stats.decode_bus_bytes_per_token / 1e6, 2),
        "io_bound_s": round(io_s, 5),
        "compute_bound_s": round(compute_s, 5),
        "physical_limit_s": round(bound, 5),
        "ratio_to_limit": round(per_token / bound, 3),
        "io_wait_s": round(wait, 5),
        "copy_s": round(copy, 5),
        "compute_s": round(compute_s, 5),
        "other_s": round(max(per_token - wait - copy - compute_s, 0.0), 5),
    }


async def bench_decode(
    vault_path: str,
    budgets: list[str],
    prompt_tokens: int = 16,
    max_tokens: int = 48,
    workers: int = 4,
    seed: int = 0,
    spec: int = 0,
    lookahead: bool = True,
    device: str | None = None,
    ring: str = "auto",
    read_parts: int | None = None,
    host_tiers: list[str] | None = None,
) -> dict[str, Any]:
    vault = Vault.open(vault_path)
    m = vault.manifest
    prompt = random_prompt(vault, prompt_tokens, seed)
    options: dict[str, Any] = {"device": device, "ring": ring, "read_parts": read_parts}
    bandwidth = raw_bandwidth(vault, workers, seed=seed)
    second = random_prompt(vault, prompt_tokens, seed + 1)
    warm, *_ = await _run(vault, m.num_records, prompt, max_tokens, workers, True, **options)
    compute_s = 1.0 / warm.decode_tok_s
    bus, image_bytes = (None, 0) if not host_tiers else await bus_bandwidth(vault, **options)
    rows = []
    for budget in budgets:
        slots = budget_slots(vault, budget)
        tiers: list[str | None] = [*host_tiers] if host_tiers else [None]
        for tier in tiers:
            host = 0 if tier is None else _tier_bytes(vault, tier, image_bytes)
            stats, steady, the_ring, direct, tier_stats = await _run(
                vault,
                slots,
                prompt,
                max_tokens,
                workers,
                then=second,
                spec=spec,
                lookahead=lookahead,
                host_memory=host,
                **options,
            )
            share = slots / m.num_records
            row = _decode_row(stats, compute_s, bandwidth, share, bus)
            head = {"budget": budget, "ring": the_ring.kind, "ring_slots": slots}
            if tier is not None:
                head |= {"host_tier": tier, "host_images": tier_stats.images}
            rows.append(
                head
                | row
                | {"huge_pages": getattr(the_ring, "huge_pages", None), "direct_io": direct}
                # A second prompt on the ring the first left: a session's steady state.
                | {"warm_ring": _decode_row(steady, compute_s, bandwidth, share, bus)}
                | ({"host_tier_stats": tier_stats.__dict__} if tier is not None else {})
            )
    return {
        "benchmark": "decode",
        "vault": str(vault.path),
        "device": device or "default",
        "experts_bytes": m.experts_bytes,
        "record_bytes": m.record.size,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "workers": workers,
        "read_parts": read_parts or "auto",
        "spec": spec,
        "lookahead": lookahead,
        "raw_disk_GBps": round(bandwidth, 3),
        "bus_GBps": round(bus, 3) if bus else None,
        "host_image_bytes": image_bytes or None,
        "compute_per_token_s": round(compute_s, 5),
        "resident_decode_tok_s": round(warm.decode_tok_s, 3),
        "runs": rows,
    }


class _PhaseReads:
    """A read backend that adds each read's bytes to the phase of the pass that routed
    last (0: the prompt's layer-major pass, 1: a decode step, the first token's included):
    every read of a streamed call follows its routing and ends before the pass goes on."""

    def __init__(
        self,
        inner: Any,
        phase: list[int],
        bytes_by_phase: list[int],
        layer_of: Any = None,
        pass_by_layer: dict[int, int] | None = None,
    ) -> None:
        self.inner, self.phase, self.bytes_by_phase = inner, phase, bytes_by_phase
        self.layer_of, self.pass_by_layer = layer_of, pass_by_layer

    async def read(self, record: int, slot: int, priority: int = 0) -> int:
        phase = self.phase[0]
        n: int = await self.inner.read(record, slot, priority)
        self.bytes_by_phase[phase] += n
        if phase == 0 and self.pass_by_layer is not None:
            layer = self.layer_of(record)
            self.pass_by_layer[layer] = self.pass_by_layer.get(layer, 0) + n
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def _prefill_once(
    vault: Vault, slots: int, prompt: list[int], workers: int, layer_major: bool, **options: Any
) -> dict[str, Any]:
    """One fresh engine prefills ``prompt`` and samples its first token: its stats, the
    bytes of the prompt's pass (all but its last token) and of the first token's step, the
    records of the pass's per-layer unions, the ring, direct reads, and whether it ran
    layer-major."""
    from smoe.compute.tracing import current_pass

    union: dict[int, set[int]] = {}
    phase, by_phase = [0], [0, 0]
    by_layer: dict[int, int] = {}  # the pass's bytes read per decoder layer

    def seen(layer: int, idx: Any) -> None:
        phase[0] = current_pass().phase
        if phase[0] == 0:
            union.setdefault(layer, set()).update(int(e) for e in idx.reshape(-1))

    context = len(prompt) + 8
    async with Engine.open(
        vault.path, slots=slots, workers=workers, max_context=context, **options
    ) as engine:
        parts = engine.debug.parts()
        runner = parts.runner
        runner.layer_major = runner.layer_major and layer_major
        engine.debug.tracer.observers.on_routing = seen
        layer_of = lambda record: vault.manifest.record_key(record)[0]  # noqa: E731
        parts.scheduler.wrap_backend(
            lambda inner: _PhaseReads(inner, phase, by_phase, layer_of, by_layer)
        )
        stats = None
        async for ev in engine.generate(prompt, max_tokens=1, stop_at_eos=False):
            stats = ev.stats or stats
        return {
            "stats": stats,
            "pass_bytes": by_phase[0],
            "first_step_bytes": by_phase[1],
            "union_records": sum(len(experts) for experts in union.values()),
            "pass_bytes_by_layer": by_layer,
            "union_records_by_layer": {layer: len(e) for layer, e in union.items()},
            "ring": parts.ring,
            "direct": parts.reader.direct,
            "layer_major": runner.layer_major,
        }


async def bench_prefill(
    vault_path: str,
    budgets: list[str],
    prompt_tokens: int | list[int] = 256,
    workers: int = 4,
    seed: int = 0,
    device: str | None = None,
    ring: str = "auto",
    schedules: list[str] | None = None,
    host_memory: int | str = 0,
) -> dict[str, Any]:
    """Each (prompt length, budget, schedule) in a fresh engine: the first token's time and
    the prompt's bytes against the bytes of each layer's union over the whole prompt (what
    reading each expert once per layer and prompt reads). ``schedules``: "layer" (the
    engine's layer-major prefill, where the architecture allows it) and/or "chunk" (each
    chunk through every layer, as before it). ``host_memory``: the host tier (0: none, so
    re-reads come from the disk; a GPU gets one by default elsewhere)."""
    vault = Vault.open(vault_path)
    stride = vault.manifest.record.stride
    lengths = [prompt_tokens] if isinstance(prompt_tokens, int) else list(prompt_tokens)
    rows = []
    for length in lengths:
        prompt = random_prompt(vault, length, seed)
        for budget in budgets:
            slots = budget_slots(vault, budget)
            for schedule in schedules or ["layer"]:
                run = await _prefill_once(
                    vault,
                    slots,
                    prompt,
                    workers,
                    schedule == "layer",
                    device=device,
                    ring=ring,
                    host_memory=host_memory,
                )
                stats, union = run["stats"], run["union_records"] * stride
                rows.append(
                    {
                        "prompt_tokens": length,
                        "budget": budget,
                        "ring_slots": slots,
                        "schedule": "layer" if run["layer_major"] else "chunk",
                        "ttft_s": round(stats.ttft_s, 4),
                        "prefill_tok_s": round(stats.prefill_tok_s, 2),
                        # the pass over all but the last prompt token, against the bytes of
                        # its per-layer unions (each expert once per layer and prompt)
                        "pass_bytes": run["pass_bytes"],
                        "union_bytes": union,
                        "bytes_over_union": round(run["pass_bytes"] / union, 4),
                        # per MoE layer: the worst layer's bytes against its own union
                        "max_layer_bytes_over_union": round(
                            max(
                                run["pass_bytes_by_layer"].get(layer, 0) / (n * stride)
                                for layer, n in run["union_records_by_layer"].items()
                            ),
                            4,
                        ),
                        # the last prompt token's step, run alone as mlx-lm runs it
                        "first_step_bytes": run["first_step_bytes"],
                        "prefill_bytes": stats.prefill_bytes,
                        "bytes_per_prompt_token": int(stats.prefill_bytes / length),
                        "unique_experts_per_call_sum": stats.prefill_unique_experts,
                        "hit_rate": round(stats.hit_rate, 4),
                        "ring": run["ring"].kind,
                        "huge_pages": getattr(run["ring"], "huge_pages", None),
                        "direct_io": run["direct"],
                    }
                )
    return {
        "benchmark": "prefill",
        "vault": str(vault.path),
        "prompt_tokens": lengths,
        "workers": workers,
        "runs": rows,
    }
