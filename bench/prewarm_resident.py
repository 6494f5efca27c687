"""Decode on a ring that holds the whole model, with and without an idle pre-warm first
(issue 27): pre-warm then reads every missing expert, so the model becomes resident.

    python bench/prewarm_resident.py [VAULT] [--rounds 2] [--tokens 64]

Each round opens a fresh engine twice (default ring; it must hold every expert), the
order alternating: one generates at once, the other pre-warms (``engine.learning.prewarm``) and waits
for those reads first, as the REPL does while a person types. Prints JSON: decode tok/s of
each run, whether it ran resident, and whether the tokens agree.
"""

from __future__ import annotations

import asyncio

import harness

import smoe.util.loop
from smoe.chat.demo import demo_vault
from smoe.engine import Engine
from smoe.sched.types import Priority


async def drain(engine: Engine) -> None:
    """Until the pre-warm reads are done (real I/O threads: poll the scheduler)."""
    sched = engine.debug.scheduler
    while sched.in_flight or sched.queue_depth(Priority.SPECULATIVE):  # noqa: ASYNC110
        await asyncio.sleep(0.005)


async def run(vault: str, prewarm: bool, tokens: int) -> dict:
    async with Engine.open(vault) as engine:
        every = engine.vault.manifest.num_records
        if engine.debug.scheduler.num_slots < every:
            raise SystemExit(
                f"the default ring holds {engine.debug.scheduler.num_slots} of {every}"
            )
        if prewarm:
            engine.learning.prewarm()
            await drain(engine)
        async for _ in engine.generate([9, 8, 7], max_tokens=4, stop_at_eos=False):
            pass  # compiled kernels
        stats, out = None, []
        async for ev in engine.generate(
            [5, 17, 99, 300, 42, 7], max_tokens=tokens, stop_at_eos=False
        ):
            stats = ev.stats or stats
            if ev.token is not None:
                out.append(ev.token)
        assert stats is not None
        return {
            "prewarm": prewarm,
            "decode_tok_s": round(stats.decode_tok_s, 1),
            "resident": bool(engine.debug.runner.resident and engine.debug.runner.resident()),
            "tokens": out,
        }


async def main() -> None:
    p = harness.parser(__doc__)
    harness.vault(p, demo=True)
    harness.rounds(p, default=2)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    vault = args.vault or str(demo_vault())
    runs = []
    for r in range(args.rounds):
        for prewarm in (False, True) if r % 2 == 0 else (True, False):
            runs.append(await run(vault, prewarm, args.tokens))
    same = len({tuple(run.pop("tokens")) for run in runs}) == 1
    harness.report(
        {"benchmark": "prewarm_resident", "vault": vault, "runs": runs, "tokens_equal": same},
        args,
    )


if __name__ == "__main__":
    smoe.util.loop.run(main())
