"""Time to first token of a follow-up chat request, with and without prefix reuse.

    python bench/serve_prefix.py VAULT [--history-tokens 300] [--memory SIZE] [--repeats 2]

A conversation's first request carries a long user message (about --history-tokens
tokens); its follow-up repeats the messages, adds the reply and a short new question.
With prefix reuse the server finds the first request's KV cache and prefills only what
follows the common prefix; where the reply sent back is ours verbatim, the follow-up
continues from the ids it was generated as, so only the new turn is prefilled
(``reply_continued``). Without reuse (the server's prefix cache emptied first) the same
follow-up prefills everything. The two are timed alternately (ABBA) in one run, each
after the same first request. Streams through HTTP (aiohttp); prints JSON.
"""

import asyncio
import json
import random
import statistics
import time

import aiohttp
import harness

import smoe.util.loop
from smoe.bench.generate import ring_options
from smoe.engine import Engine
from smoe.serve.app import Server, ServerOptions, serve


async def main() -> None:
    p = harness.parser(__doc__)
    harness.vault(p)
    p.add_argument("--history-tokens", type=int, default=300)
    harness.memory(p, ring=True, default=None)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    async with Engine.open(args.vault, **ring_options(args.vault, args.memory)) as engine:
        if engine.tokenizer is None:
            raise SystemExit(f"{args.vault} has no tokenizer: chat requests need one")
        rng = random.Random(0)
        vocab = engine.vault.manifest.shape.vocab_size
        words = engine.tokenizer.decode(rng.choices(range(200, vocab), k=args.history_tokens))
        options = ServerOptions(prewarm_when_idle=False)
        server = Server(engine, options)
        loop = asyncio.get_running_loop()
        port = loop.create_future()
        task = loop.create_task(
            serve(engine, "127.0.0.1", 0, options, ready=port.set_result, server=server)
        )
        url = f"http://127.0.0.1:{await port}/v1/chat/completions"
        http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

        async def ask(messages: list[dict]) -> tuple[str, float, int]:
            """(reply, time to first token, prompt tokens) of one streamed request."""
            body = {"messages": messages, "max_tokens": 8, "temperature": 0, "stream": True}
            start, ttft, text, usage = time.perf_counter(), None, [], {}
            async with http.post(url, json=body) as r:
                r.raise_for_status()
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    delta = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else ""
                    if delta:
                        text.append(delta)
                        ttft = ttft or time.perf_counter() - start
                    usage = chunk.get("usage") or usage
            return "".join(text), ttft or 0.0, usage.get("prompt_tokens", 0)

        first = [{"role": "user", "content": words}]
        reply, _, first_tokens = await ask(first)  # warm-up, and the reply to build on
        follow = [
            *first,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "And what follows from that?"},
        ]
        times: dict[str, list[float]] = {"reuse": [], "no_reuse": []}
        prefilled: dict[str, list[int]] = {"reuse": [], "no_reuse": []}
        continued: dict[str, list[int]] = {"reuse": [], "no_reuse": []}
        for mode in ["reuse", "no_reuse", "no_reuse", "reuse"] * (args.repeats // 2 or 1):
            server.cache.entries.clear()
            await ask(first)  # the same state before each timed follow-up
            if mode == "no_reuse":
                server.cache.entries.clear()
            prefilled0, continued0 = server.prefilled_tokens, server.reply_follow_ups
            _, ttft, follow_tokens = await ask(follow)
            times[mode].append(ttft)
            prefilled[mode].append(server.prefilled_tokens - prefilled0)
            continued[mode].append(server.reply_follow_ups - continued0)
        await http.close()
        task.cancel()
    reuse, fresh = statistics.median(times["reuse"]), statistics.median(times["no_reuse"])
    harness.report(
        {
            "benchmark": "serve_prefix",
            "vault": args.vault,
            "memory": args.memory,
            "first_request_prompt_tokens": first_tokens,
            "follow_up_prompt_tokens": follow_tokens,
            "ttft_s": {k: [round(t, 3) for t in v] for k, v in times.items()},
            # prompt tokens run before the first token (the last one runs with it)
            "prefilled_tokens": prefilled,
            "reply_continued": continued,
            "median_ttft_reuse_s": round(reuse, 3),
            "median_ttft_no_reuse_s": round(fresh, 3),
            "speedup": round(fresh / reuse, 2),
        },
        args,
    )


if __name__ == "__main__":
    smoe.util.loop.run(main())
