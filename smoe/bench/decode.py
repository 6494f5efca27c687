"""`smoe bench decode` / `smoe bench prefill`: where each token's time goes, against the
physical limit measured in the same run.

decode: for each budget a fresh engine (empty ring, O_DIRECT so the page cache is out of
the way) generates ``max_tokens`` greedy tokens after a short prompt (cold), then as many
after a second prompt on the ring the first left (``warm_ring``: the steady state of a
session, where the ring already holds the popular experts). Beside them, in the same
run: the raw disk bandwidth (plain O_DIRECT preadv of whole records, the engine's worker
count) and the compute time per token (decode with every expert resident: no I/O). The
physical limit for a budget is max(bytes missed per token / raw bandwidth, compute per
token): no engine can beat both the disk and the arithmetic.

prefill: time to first token and prefill tok/s for a long prompt at each budget, with the
bytes read and the distinct experts per (chunk, layer).
"""

from __future__ import annotations

import random
from typing import Any

from smoe.bench.generate import budget_slots
from smoe.engine import Engine
from smoe.forecast.workload import fill_ring, random_prompt
from smoe.io.disk_probe import baseline_run, drop_file_cache
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
        return runs[0], runs[1] if then is not None else None, engine.ring, engine.reader.direct


def raw_bandwidth(vault: Vault, workers: int, records: int = 96, seed: int = 0) -> float:
    """GB/s of plain O_DIRECT preadv of whole random records (the disk's own limit)."""
    m = vault.manifest
    order = random.Random(seed).sample(range(m.num_records), min(records, m.num_records))
    drop_file_cache(vault.experts_path)
    return baseline_run(vault.experts_path, m.record.stride, order, workers).gbps


def _decode_row(stats: Any, compute_s: float, bandwidth: float, share: float) -> dict[str, Any]:
    """One ring's decode figures beside the physical limit: max(the I/O bound of its bytes
    per token at ``bandwidth`` GB/s, ``compute_s`` per token all resident)."""
    per_token = 1.0 / stats.decode_tok_s
    io_s = stats.decode_bytes_per_token / (bandwidth * 1e9)
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
) -> dict[str, Any]:
    vault = Vault.open(vault_path)
    m = vault.manifest
    prompt = random_prompt(vault, prompt_tokens, seed)
    options: dict[str, Any] = {"device": device, "ring": ring, "read_parts": read_parts}
    bandwidth = raw_bandwidth(vault, workers, seed=seed)
    second = random_prompt(vault, prompt_tokens, seed + 1)
    warm, *_ = await _run(vault, m.num_records, prompt, max_tokens, workers, True, **options)
    compute_s = 1.0 / warm.decode_tok_s
    rows = []
    for budget in budgets:
        slots = budget_slots(vault, budget)
        stats, steady, the_ring, direct = await _run(
            vault,
            slots,
            prompt,
            max_tokens,
            workers,
            then=second,
            spec=spec,
            lookahead=lookahead,
            **options,
        )
        share = slots / m.num_records
        row = _decode_row(stats, compute_s, bandwidth, share)
        rows.append(
            {"budget": budget, "ring": the_ring.kind, "ring_slots": slots}
            | row
            | {"huge_pages": getattr(the_ring, "huge_pages", None), "direct_io": direct}
            # A second prompt on the ring the first left: a session's steady state.
            | {"warm_ring": _decode_row(steady, compute_s, bandwidth, share)}
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
        "compute_per_token_s": round(compute_s, 5),
        "resident_decode_tok_s": round(warm.decode_tok_s, 3),
        "runs": rows,
    }


async def bench_prefill(
    vault_path: str,
    budgets: list[str],
    prompt_tokens: int = 256,
    workers: int = 4,
    seed: int = 0,
    device: str | None = None,
    ring: str = "auto",
) -> dict[str, Any]:
    vault = Vault.open(vault_path)
    prompt = random_prompt(vault, prompt_tokens, seed)
    rows = []
    for budget in budgets:
        slots = budget_slots(vault, budget)
        stats, _, the_ring, direct = await _run(
            vault, slots, prompt, 1, workers, device=device, ring=ring
        )
        rows.append(
            {
                "budget": budget,
                "ring_slots": slots,
                "ttft_s": round(stats.ttft_s, 4),
                "prefill_tok_s": round(stats.prefill_tok_s, 2),
                "prefill_bytes": stats.prefill_bytes,
                "bytes_per_prompt_token": int(stats.prefill_bytes / prompt_tokens),
                "unique_experts_per_chunk_layer_sum": stats.prefill_unique_experts,
                "hit_rate": round(stats.hit_rate, 4),
                "ring": the_ring.kind,
                "huge_pages": getattr(the_ring, "huge_pages", None),
                "direct_io": direct,
            }
        )
    return {
        "benchmark": "prefill",
        "vault": str(vault.path),
        "prompt_tokens": prompt_tokens,
        "workers": workers,
        "runs": rows,
    }
