"""The largest gap between two tokens of a decoding request while another request's long
prompt prefills, layer-major (the engine's prefill) against chunk by chunk (before it), in
one run: each schedule in a fresh engine, alternating over --rounds.

    python bench/prefill_gap.py VAULT [--prompt-tokens 4096] [--memory 25%] [--rounds 1]

A short request decodes; once it has its first tokens, a request with a random prompt of
--prompt-tokens arrives, and the short one's token times are recorded until the long one's
first token. Reports per schedule: the largest and the median gap between the short
request's tokens in that window, how many it got, and the long prompt's time to first
token. JSON out.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time

import harness

import smoe.util.loop
from smoe.bench.generate import budget_slots
from smoe.engine import Engine
from smoe.forecast.workload import random_prompt
from smoe.vault.format import Vault


async def one(vault: Vault, schedule: str, prompt_tokens: int, slots: int) -> dict:
    long_prompt = random_prompt(vault, prompt_tokens, seed=1)
    short_prompt = random_prompt(vault, 5, seed=2)
    async with Engine.open(vault.path, slots=slots, max_context=prompt_tokens + 64) as engine:
        runner = engine.debug.runner
        runner.layer_major = runner.layer_major and schedule == "layer"
        times: list[float] = []
        decoding = asyncio.Event()

        async def short() -> None:
            events = engine.generate(short_prompt, max_tokens=prompt_tokens, stop_at_eos=False)
            async for ev in events:
                if ev.token is not None:
                    times.append(time.perf_counter())
                    if len(times) >= 3:
                        decoding.set()

        task = asyncio.ensure_future(short())
        await decoding.wait()
        start = time.perf_counter()
        first = None
        async for ev in engine.generate(long_prompt, max_tokens=1, stop_at_eos=False):
            if ev.token is not None and first is None:
                first = time.perf_counter()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert first is not None
        window = [start, *[t for t in times if start < t <= first], first]
        gaps = [b - a for a, b in zip(window, window[1:], strict=False)]
        return {
            "schedule": "layer" if runner.layer_major else "chunk",
            "max_gap_s": round(max(gaps), 3),
            "median_gap_s": round(statistics.median(gaps), 4),
            "short_tokens_during": len(window) - 2,
            "long_ttft_s": round(first - start, 2),
        }


async def main() -> None:
    p = harness.parser(__doc__)
    harness.vault(p)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    harness.memory(p, ring=True, default="25%")
    harness.rounds(p, default=1)
    args = p.parse_args()
    vault = Vault.open(args.vault)
    slots = budget_slots(vault, args.memory)
    runs: dict[str, list[dict]] = {"layer": [], "chunk": []}
    for i in range(args.rounds):
        for schedule in ("layer", "chunk") if i % 2 == 0 else ("chunk", "layer"):
            runs[schedule].append(await one(vault, schedule, args.prompt_tokens, slots))
    harness.report(
        {
            "benchmark": "prefill_gap",
            "vault": str(vault.path),
            "prompt_tokens": args.prompt_tokens,
            "memory": args.memory,
            "ring_slots": slots,
            "runs": runs,
            "max_gap_s": {k: max(r["max_gap_s"] for r in v) for k, v in runs.items()},
        },
        args,
    )


if __name__ == "__main__":
    smoe.util.loop.run(main())
