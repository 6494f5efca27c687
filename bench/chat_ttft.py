"""Second-turn time to first token after a short and a long first turn.

    python bench/chat_ttft.py [VAULT] [--first 100,1000] [--reply 16]

A follow-up turn prefills only what is new (the conversation keeps its KV cache), so its
wait should not depend on how long the first turn was. Prints JSON.
"""

import argparse
import json
import time

import smoe.aio
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
    async with Engine.open(vault, memory=memory) as engine:
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


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("vault", nargs="?", default=None)
    p.add_argument("--first", default="100,1000")
    p.add_argument("--reply", type=int, default=16)
    p.add_argument("--memory", default=None)
    args = p.parse_args()
    vault = args.vault
    if vault is None:
        from smoe.chat.demo import demo_vault

        vault = str(demo_vault())
    runs = [await turn_ttft(vault, int(n), args.reply, args.memory) for n in args.first.split(",")]
    a, b = runs[0]["second_turn_ttft_s"], runs[-1]["second_turn_ttft_s"]
    print(
        json.dumps(
            {
                "benchmark": "chat_ttft",
                "vault": vault,
                "memory": args.memory,
                "runs": runs,
                "second_turn_ttft_ratio_long_over_short": round(b / a, 3),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    smoe.aio.run(main())
