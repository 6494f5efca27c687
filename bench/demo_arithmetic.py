"""The demo's first reply and decode rate under MLX's CPU kernels and under S-MoE's.

    python bench/demo_arithmetic.py [VAULT] [--rounds 3] [--max-tokens 64]

Each run is a fresh `smoe generate` process on the demo vault (built if missing), as a
user's `smoe chat` starts: a chat-templated prompt, greedy, ``--cpu-kernels mlx`` and
``--cpu-kernels auto`` alternating. ``first_reply_s`` is the process's start to its first
token (imports, open, the kernels' checks, the prompt); ``ttft_s`` and ``decode_tok_s`` the
engine's own. The greedy tokens of every run must be equal. Prints JSON.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import harness

PROMPT = "Tell me of the house of David and of the kings that came after him."


def one_run(vault: str, kernels: str, max_tokens: int) -> dict:
    command = [
        sys.executable, "-m", "smoe.cli", "generate", vault, "--prompt", PROMPT,
        "--max-tokens", str(max_tokens), "--temp", "0", "--json", "--device", "cpu",
        "--cpu-kernels", kernels,
    ]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    out = json.loads(done.stdout)
    stats = out["stats"]
    decode_s = (len(out["tokens"]) - 1) / stats["decode_tok_s"] if stats["decode_tok_s"] else 0
    return {
        "tokens": out["tokens"],
        "wall_s": round(wall, 3),
        "first_reply_s": round(wall - decode_s, 3),
        "ttft_s": round(stats["ttft_s"], 4),
        "decode_tok_s": round(stats["decode_tok_s"], 2),
        "arithmetic": stats.get("arithmetic"),
    }


def main() -> None:
    p = harness.parser(__doc__)
    harness.vault(p, demo=True)
    harness.rounds(p, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    if args.vault is None:
        from smoe.chat.demo import demo_vault

        args.vault = str(demo_vault())
    runs: dict[str, list[dict]] = {"mlx": [], "auto": []}
    for _ in range(args.rounds):
        for kernels in runs:
            runs[kernels].append(one_run(args.vault, kernels, args.max_tokens))
    tokens = {tuple(r.pop("tokens")) for rs in runs.values() for r in rs}

    def median(kernels: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs[kernels]), 4)

    summary = {
        k: {key: median(k, key) for key in ("first_reply_s", "ttft_s", "decode_tok_s")}
        for k in runs
    }
    harness.report(
        {
            "benchmark": "demo_arithmetic",
            "vault": args.vault,
            "prompt": PROMPT,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "tokens_equal": len(tokens) == 1,
            "median": summary,
            "first_reply_speedup": round(
                summary["mlx"]["first_reply_s"] / summary["auto"]["first_reply_s"], 3
            ),
            "ttft_speedup": round(summary["mlx"]["ttft_s"] / summary["auto"]["ttft_s"], 3),
            "decode_speedup": round(
                summary["auto"]["decode_tok_s"] / summary["mlx"]["decode_tok_s"], 3
            ),
            "runs": runs,
        },
        args,
    )


if __name__ == "__main__":
    main()
