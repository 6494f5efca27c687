"""One rank of the expert-parallel tests (tests/system/test_distributed.py), started once per rank.

    python -m tests.distributed_worker VAULT OUT SLOTS PROMPT_IDS STEPS FORCED_IDS [whole]

Every rank runs the same requests on an engine joined to the group: teacher-forced logits
over the prompt, the decode path's logits with the reference's tokens forced, greedy
generation, and the logits of prompt + generated tokens. Rank r writes OUT/rank{r}.npz
and OUT/rank{r}.json (its I/O, the gathered I/O of every rank, the tokens).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from smoe.compute.streaming import StreamingExperts
from smoe.engine import Engine
from smoe.util.loop import run
from tests.exact.test_engine_exact import engine_decode, engine_generate


async def main(
    vault: str,
    out: Path,
    slots: int,
    prompt: list[int],
    steps: int,
    forced: list[int],
    whole: bool = False,
) -> None:
    async with Engine.open(vault, slots=slots, distributed="any") as engine:
        assert engine.group.distributed
        if whole:  # the GPU's way on any device: each layer in one call, as mlx-lm makes it
            for module in engine.debug.runner.model.modules():
                if isinstance(module, StreamingExperts):
                    module.overlap = False
        rank = engine.group.rank
        logits = await engine.logits(prompt)
        step_logits, picks = await engine_decode(engine, prompt, forced)
        tokens = await engine_generate(engine, prompt, steps)
        full = await engine.logits(prompt + tokens)
        io = await engine.group.rank_stats()
        np.savez(out / f"rank{rank}.npz", logits=logits, steps=np.stack(step_logits), full=full)
        report = {
            "rank": rank,
            "size": engine.group.size,
            "ring_slots": engine.stats().ring.slots,
            "owned": [r["experts_owned"] for r in io],
            "picks": picks,
            "tokens": tokens,
            "io": io,
        }
        (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    vault_arg, out_arg, slots_arg, prompt_arg, steps_arg, forced_arg = sys.argv[1:7]
    run(
        main(
            vault_arg,
            Path(out_arg),
            int(slots_arg),
            [int(t) for t in prompt_arg.split(",")],
            int(steps_arg),
            [int(t) for t in forced_arg.split(",")],
            sys.argv[7:8] == ["whole"],
        )
    )
