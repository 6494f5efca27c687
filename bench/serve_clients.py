"""Total decode throughput of `smoe serve` with N concurrent greedy clients.

    python bench/serve_clients.py VAULT [--clients 1,2,4,8] [--max-tokens 16] [--memory SIZE]

Starts the server in-process on a free port and drives it with the openai client. Prints JSON.
"""

import argparse
import asyncio
import json
import time

import openai

import smoe.aio
from smoe.engine import Engine
from smoe.serve.app import ServerOptions, serve


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("vault")
    p.add_argument("--clients", default="1,2,4,8")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--memory", default=None)
    args = p.parse_args()
    rows = []
    async with Engine.open(args.vault, memory=args.memory) as engine:
        loop = asyncio.get_running_loop()
        port = loop.create_future()
        task = loop.create_task(
            serve(engine, "127.0.0.1", 0, ServerOptions(max_queue=64), ready=port.set_result)
        )
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{await port}/v1", api_key="x", max_retries=0
        )

        async def one(i: int) -> int:
            r = await client.completions.create(
                model="smoe", prompt=[100 + i, 7, 9, 11], max_tokens=args.max_tokens, temperature=0
            )
            return r.usage.completion_tokens

        for n in (int(x) for x in args.clients.split(",")):
            start = time.perf_counter()
            tokens = sum(await asyncio.gather(*(one(i) for i in range(n))))
            seconds = time.perf_counter() - start
            rows.append(
                {
                    "clients": n,
                    "tokens": tokens,
                    "seconds": round(seconds, 3),
                    "total_tok_s": round(tokens / seconds, 2),
                }
            )
        task.cancel()
    print(
        json.dumps(
            {
                "benchmark": "serve_clients",
                "vault": args.vault,
                "batched_decode": False,
                "runs": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    smoe.aio.run(main())
