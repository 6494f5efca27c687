"""What ``--kv-bits`` costs and saves at a long context: KV cache bytes, prefill and decode
speed for a float cache, 8 and 4 bits, alternated in rounds within one run (JSON).

    python bench/kv_bits.py VAULT [--context 1800] [--max-tokens 32] [--rounds 3]
        [--ring all] [--device cpu|gpu]

Each round opens one engine per setting (in rotating order) and generates greedily after a
``--context``-token prompt of random ids; the medians over rounds are reported, and the
ratios to the float cache of the same round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import harness
import numpy as np

from smoe.bench.generate import ring_options
from smoe.engine import Engine
from smoe.util.loop import run

SETTINGS: list[int | None] = [None, 8, 4]


async def one(vault: str, bits: int | None, prompt: list[int], args: argparse.Namespace) -> Any:
    ring = ring_options(vault, args.ring)  # the same ring for every setting
    async with Engine.open(vault, **ring, kv_bits=bits, device=args.device) as engine:
        async for ev in engine.generate(
            prompt, max_tokens=args.max_tokens, temperature=0.0, stop_at_eos=False
        ):
            if ev.stats is not None:
                return ev.stats


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from smoe.vault.format import Vault

    vocab = Vault.open(args.vault).config()["vocab_size"]
    prompt = np.random.default_rng(0).integers(2, vocab, args.context).tolist()
    rows: dict[str, list[dict[str, float]]] = {str(b): [] for b in SETTINGS}
    for r in range(args.rounds):
        order = SETTINGS[r % 3 :] + SETTINGS[: r % 3]  # rotate who goes first
        for bits in order:
            s = await one(args.vault, bits, prompt, args)
            rows[str(bits)].append(
                {
                    "kv_cache_bytes": s.kv_cache_bytes,
                    "prefill_tok_s": s.prefill_tok_s,
                    "decode_tok_s": s.decode_tok_s,
                }
            )
    out: dict[str, Any] = {
        "vault": args.vault,
        "context": args.context,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "ring": args.ring,
        "device": args.device or "default",
        "settings": {},
    }
    base = rows["None"]
    for key, runs in rows.items():
        out["settings"][key] = {
            name: statistics.median(run_[name] for run_ in runs) for name in runs[0]
        } | {
            f"{name}_ratio_to_float": statistics.median(
                a[name] / b[name] for a, b in zip(runs, base, strict=True)
            )
            for name in ("kv_cache_bytes", "prefill_tok_s", "decode_tok_s")
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__)
    harness.vault(p)
    p.add_argument("--context", type=int, default=1800)
    p.add_argument("--max-tokens", type=int, default=32)
    harness.rounds(p, default=3)
    p.add_argument("--ring", default=None, help="ring size: a share of the experts, all, a size")
    harness.device(p)
    args = p.parse_args(argv)
    harness.report(run(main_async(args)), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
