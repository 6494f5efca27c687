"""Second-turn time to first token after a short and a long first turn.

    python bench/chat_ttft.py [VAULT] [--first 100,1000] [--reply 16] [--reference]

A follow-up turn prefills only what is new (the conversation keeps its KV cache), so its
wait should not depend on how long the first turn was, except for attention over the
longer cache. ``--reference`` measures that part alone: mlx-lm in memory (the vault
exported) runs a chunk of the follow-up's size after each first turn's cached length
(median of 5). Prints JSON.
"""

import statistics
import tempfile
import time
from pathlib import Path

import harness

import smoe.util.loop
from smoe.bench.generate import ring_options
from smoe.engine import Engine

WORDS = [
    "the",
    "sea",
    "was",
    "calm",
    "and",
    "the",
    "ships",
    "sailed",
    "west",
    "under",
    "a",
    "pale",
    "sky",
    "while",
    "gulls",
    "circled",
    "the",
    "harbour",
    "and",
    "old",
    "sailors",
    "told",
    "stories",
    "of",
    "storms",
]


async def turn_ttft(vault: str, first_tokens: int, reply: int, memory: str | None) -> dict:
    async with Engine.open(vault, **ring_options(vault, memory)) as engine:
        conv = engine.conversation(system="You are a helpful assistant.")
        text, n = [], 0
        while n < first_tokens:  # grow a user message to about first_tokens tokens
            text.append(WORDS[len(text) % len(WORDS)])
            n = len(engine.encode(" ".join(text)))
        first = None
        async for ev in conv.send(" ".join(text), max_tokens=reply):
            first = ev.stats or first
        start = time.perf_counter()
        second = None
        ttft = None
        async for ev in conv.send("Thanks. And then what happened?", max_tokens=reply):
            if ttft is None and ev.token is not None:
                ttft = time.perf_counter() - start
            second = ev.stats or second
        return {
            "first_turn_user_tokens": n,
            "first_turn_prompt_tokens": first.prompt_tokens,
            "first_turn_ttft_s": round(first.ttft_s, 4),
            "second_turn_prompt_tokens": second.prompt_tokens,
            "second_turn_prefilled_tokens": second.prefilled_tokens,
            "second_turn_ttft_s": round(ttft, 4),
            "second_turn_ttft_engine_s": round(second.ttft_s, 4),
        }


def reference_chunk_s(vault: str, cached: list[int], chunk: int) -> list[float]:
    """mlx-lm in memory: seconds for a ``chunk``-token forward pass after each cached
    length (median of 5, float32 as the engine computes on a CPU)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from smoe.vault.export import export_mlx
    from smoe.vault.format import Vault

    with tempfile.TemporaryDirectory() as out:
        model, _ = load_model(export_mlx(Vault.open(vault), Path(out) / "mlx"))
    model.set_dtype(mx.float32)
    result = []
    for n in cached:
        times = []
        for _ in range(5):
            cache = make_prompt_cache(model)
            ids = mx.array([[10 + i % 4000 for i in range(n)]])
            for start in range(0, n, 64):
                model(ids[:, start : start + 64], cache=cache)
                mx.eval([c.state for c in cache])
            x = mx.array([[100 + i for i in range(chunk)]])
            t = time.perf_counter()
            mx.eval(model(x, cache=cache))
            times.append(time.perf_counter() - t)
        result.append(round(statistics.median(times), 4))
    return result


async def main() -> None:
    p = harness.parser(__doc__)
    harness.vault(p, demo=True)
    p.add_argument("--first", default="100,1000")
    p.add_argument("--reply", type=int, default=16)
    harness.memory(p, ring=True, default=None)
    p.add_argument("--reference", action="store_true", help="also time mlx-lm in memory")
    args = p.parse_args()
    vault = args.vault
    if vault is None:
        from smoe.chat.demo import demo_vault

        vault = str(demo_vault())
    runs = [await turn_ttft(vault, int(n), args.reply, args.memory) for n in args.first.split(",")]
    a, b = runs[0]["second_turn_ttft_s"], runs[-1]["second_turn_ttft_s"]
    report = {
        "benchmark": "chat_ttft",
        "vault": vault,
        "memory": args.memory,
        "runs": runs,
        "second_turn_ttft_ratio_long_over_short": round(b / a, 3),
    }
    if args.reference:
        cached = [r["second_turn_prompt_tokens"] - r["second_turn_prefilled_tokens"] for r in runs]
        ref = reference_chunk_s(vault, cached, runs[0]["second_turn_prefilled_tokens"])
        report["mlx_lm_in_memory_chunk_s"] = dict(zip(map(str, cached), ref, strict=True))
        report["mlx_lm_ratio_long_over_short"] = round(ref[-1] / ref[0], 3)
    harness.report(report, args)


if __name__ == "__main__":
    smoe.util.loop.run(main())
