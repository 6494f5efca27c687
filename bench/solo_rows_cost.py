"""What the kernel rules (smoe.compute.solo_rows) cost one request: resident decode with
them against without them, in one run (issue 26).

    python bench/solo_rows_cost.py VAULT [--device gpu] [--rounds 3] [--tokens 64]

Opens the engine with every expert resident twice per round, rules on (the device's
default) and off (``solo_rows=False``), alternating which goes first (ABBA), and decodes
the same random prompt greedily; a lone request's calls already have its reference's
shapes, so what the rules add is the wrappers' bookkeeping. Prints JSON: decode tok/s of
each run, the median ratio on/off, and whether the tokens agree.
"""

from __future__ import annotations

import json
import statistics
import sys

import harness

import smoe.util.loop
from smoe.bench.generate import random_prompt
from smoe.bench.resident import fill_ring
from smoe.engine import Engine


async def decode(vault: str, device: str | None, rules: bool | None, prompt, n: int) -> dict:
    from smoe.vault.format import Vault

    every = Vault.open(vault).manifest.num_records
    async with Engine.open(vault, slots=every, device=device, solo_rows=rules) as engine:
        await fill_ring(engine)
        tokens, stats = [], None
        for _ in range(2):  # the first pass compiles kernels; the second is timed
            tokens = []
            async for ev in engine.generate(prompt, max_tokens=n, stop_at_eos=False):
                if ev.token is not None:
                    tokens.append(ev.token)
                if ev.stats is not None:
                    stats = ev.stats
        assert stats is not None
        return {
            "rules": None
            if engine.debug.runner.rules is None
            else engine.debug.runner.rules.measured,
            "decode_tok_s": round(stats.decode_tok_s, 2),
            "built_ahead": engine.debug.runner.built_ahead,
            "tokens": tokens,
        }


async def main() -> None:
    p = harness.parser(__doc__)
    harness.vault(p)
    harness.device(p)
    harness.rounds(p, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    args = p.parse_args()
    from smoe.vault.format import Vault

    prompt = random_prompt(Vault.open(args.vault), args.prompt_tokens, seed=0)
    on_default = None if args.device == "gpu" else True  # the CPU has none by default
    runs, ratios, same = [], [], True
    for r in range(args.rounds):
        order = (on_default, False) if r % 2 == 0 else (False, on_default)
        got = {
            rules: await decode(args.vault, args.device, rules, prompt, args.tokens)
            for rules in order
        }
        on, off = got[on_default], got[False]
        ratios.append(on["decode_tok_s"] / off["decode_tok_s"])
        same = same and on.pop("tokens") == off.pop("tokens")
        runs.append({"round": r, "on": on, "off": off})
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    harness.report(
        {
            "benchmark": "solo_rows_cost",
            "vault": args.vault,
            "device": args.device,
            "runs": runs,
            "on_over_off_median": round(statistics.median(ratios), 3),
            "tokens_equal": same,
        },
        args,
    )


if __name__ == "__main__":
    smoe.util.loop.run(main())
