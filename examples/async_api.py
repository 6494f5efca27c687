"""Stream a reply from a vault with S-MoE's async API, then ask a follow-up that reuses
the conversation's KV cache.

    python examples/async_api.py [VAULT]      # default: the built-in demo model
"""

import sys

import smoe
import smoe.util.loop
from smoe.chat.demo import demo_vault


async def main(vault: str) -> None:
    async with smoe.Engine.open(vault, memory="1GB") as engine:  # the whole process
        chat = engine.conversation(system="You are a helpful assistant.")
        for question in ("What is a mixture of experts?", "Say it in three words."):
            print(f"> {question}")
            async for event in chat.send(question, max_tokens=40, temperature=0.7, seed=0):
                print(event.text, end="", flush=True)
                if event.stats:
                    s = event.stats
                    print(
                        f"\n[{s.prefilled_tokens} new prompt tokens, first token "
                        f"{s.ttft_s:.2f} s, {s.decode_tok_s:.1f} tok/s, "
                        f"hit rate {100 * s.hit_rate:.0f}%]"
                    )


if __name__ == "__main__":
    smoe.util.loop.run(main(sys.argv[1] if len(sys.argv) > 1 else str(demo_vault(print))))
