"""`smoe bench generate`: prefill and decode at several memory budgets, one JSON report.

Each budget gets a fresh engine (an empty ring; O_DIRECT keeps the page cache out of it),
one warm-up generation on another prompt is NOT done on purpose: the first prompt is cold,
as a user's first question is. Reported per budget: time to first token, prefill tok/s,
decode tok/s, hit rate, bytes per decoded token, share of decode time waiting for reads.
"""

from __future__ import annotations

from typing import Any

from smoe.engine import Engine
from smoe.errors import SmoeError
from smoe.forecast.workload import random_prompt
from smoe.util.sizes import parse_size, slots_for_budget
from smoe.vault.format import Vault


def ring_options(vault: Vault | str, ring: str | None) -> dict[str, Any]:
    """Engine.open options for a benchmark's ring budget (``budget_slots``; None: the
    engine's default). Benchmarks size the ring alone: --memory is the whole process."""
    if ring is None:
        return {}
    v = vault if isinstance(vault, Vault) else Vault.open(vault)
    return {"slots": budget_slots(v, ring)}


def budget_slots(vault: Vault, budget: str) -> int:
    """'min' (one token's top-k), 'half' (half the experts), 'all', a share of the experts
    like '25%', or a size like 2GB (in records of the vault's stride)."""
    m = vault.manifest
    top_k = m.shape.experts_per_token
    if budget == "min":
        return top_k
    if budget == "half":
        return max(top_k, m.num_records // 2)
    if budget == "all":
        return m.num_records
    if budget.endswith("%"):
        try:
            share = float(budget[:-1]) / 100
        except ValueError:
            raise SmoeError(f"cannot read budget {budget!r}; write it like 25%") from None
        if not 0 < share <= 1:
            raise SmoeError(f"budget {budget} must be a share in (0%, 100%]")
        return max(top_k, min(m.num_records, round(share * m.num_records)))
    return max(
        top_k, slots_for_budget(parse_size(budget), m.record.stride, max_slots=m.num_records)
    )


async def bench_generate(
    vault_path: str,
    budgets: list[str],
    prompt_tokens: int = 128,
    max_tokens: int = 32,
    workers: int = 4,
    seed: int = 0,
) -> dict[str, Any]:
    vault = Vault.open(vault_path)
    m = vault.manifest
    prompt = random_prompt(vault, prompt_tokens, seed)
    rows = []
    for budget in budgets:
        slots = budget_slots(vault, budget)
        async with Engine.open(vault.path, slots=slots, workers=workers) as engine:
            tokens: list[int] = []
            stats = None
            async for ev in engine.generate(prompt, max_tokens=max_tokens, stop_at_eos=False):
                if ev.token is not None:
                    tokens.append(ev.token)
                if ev.stats is not None:
                    stats = ev.stats
            assert stats is not None
            decode_reads = stats.decode_bytes_per_token / m.record.stride
            rows.append(
                {
                    "budget": budget,
                    "ring_slots": slots,
                    "ring_bytes": slots * m.record.stride,
                    "ring_share_of_experts": round(slots / m.num_records, 3),
                    "huge_pages": engine.debug.parts().ring.huge_pages,
                    "direct_io": engine.debug.parts().reader.direct,
                    "ttft_s": round(stats.ttft_s, 4),
                    "prefill_tok_s": round(stats.prefill_tok_s, 2),
                    "decode_tok_s": round(stats.decode_tok_s, 3),
                    "hit_rate": round(stats.hit_rate, 4),
                    "decode_hit_rate": round(stats.decode_hit_rate, 4),
                    "decode_bytes_per_token": int(stats.decode_bytes_per_token),
                    "decode_reads_per_token": round(decode_reads, 2),
                    "decode_io_wait_share": round(stats.decode_io_wait_share, 3),
                    "prefill_bytes": stats.prefill_bytes,
                    "prefill_unique_experts": stats.prefill_unique_experts,
                    "bytes_read": stats.bytes_read,
                    "tokens": tokens,
                }
            )
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    return {
        "benchmark": "generate",
        "vault": str(vault.path),
        "model": m.shape.model_type,
        "experts_bytes": m.experts_bytes,
        "record_bytes": m.record.size,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "workers": workers,
        "same_tokens_at_every_budget": same,
        "runs": rows,
    }
