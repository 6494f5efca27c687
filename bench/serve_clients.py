"""Total throughput of `smoe serve` with N concurrent greedy clients, batched decode
against one request at a time, measured in the same run.

    python bench/serve_clients.py VAULT [--clients 1,2,4,8] [--max-tokens 32]
                                        [--prompt-tokens 16] [--memory SIZE] [--text FILE]
                                        [--fill] [--solo-rows auto|on|off]
                                        [--client-process]

Starts the server in-process on a free port and drives it over HTTP (aiohttp). For
each client count it runs the batched server (max_batch 8) and the one-at-a-time server
(max_batch 1) on the same engine, alternating which goes first (ABBA), with the same fresh
random prompts (random token ids, or with --text slices of that text at random
offsets; prefix reuse is off, so both prefill them fully); ``same_text`` says
whether every client got the same completion both ways. Every client asks for exactly
--max-tokens (no stop at EOS). Prints JSON; total_tok_s counts completion tokens over
the wall time of the whole round, prefill included. --fill reads every expert first (a
ring that holds them all: the resident case); --solo-rows sets the kernel rules
(smoe.compute.solo_rows; auto: the device's). --client-process runs the clients in a
process of their own, off the server's event loop and GIL, as real clients are. Each run's
``steps`` is the engine's step timeline for it (smoe.compute.timeline: medians by rows of
the host's build, queue and wait per step, the step's period, and the loop's share).
"""

import asyncio
import json
import random
import sys
import time
from pathlib import Path

import aiohttp
import harness

import smoe.util.loop
from smoe.bench.generate import ring_options
from smoe.engine import Engine
from smoe.serve.app import ServerOptions, serve


async def stream_one(
    http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int
) -> tuple[int, float, str]:
    """Stream one completion; return (completion tokens, time to first token, text)."""
    start = time.perf_counter()
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    ttft, tokens, text = None, 0, []
    async with http.post(url, json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                text.append(chunk["choices"][0]["text"])
                if ttft is None:
                    ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens, ttft or 0.0, "".join(text)


async def drive(
    url: str, prompts: list[list[int]], max_tokens: int
) -> tuple[float, list[tuple[int, float, str]]]:
    """Every prompt's stream at once; (wall seconds, each stream's result)."""
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_one(http, url, p, max_tokens) for p in prompts))
        return time.perf_counter() - start, list(results)


def drive_in_process(
    url: str, prompts: list[list[int]], max_tokens: int
) -> tuple[float, list[tuple[int, float, str]]]:
    """``drive`` in a client process of its own (--client-process)."""
    return smoe.util.loop.run(drive(url, prompts, max_tokens))


async def main() -> None:
    p = harness.parser(__doc__)
    harness.vault(p)
    p.add_argument("--clients", default="1,2,4,8")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=16)
    harness.memory(p, ring=True, default=None)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--text", default=None, help="prompts cut from this text file")
    p.add_argument("--fill", action="store_true", help="read every expert before timing")
    p.add_argument("--solo-rows", default="auto", choices=["auto", "on", "off"])
    p.add_argument(
        "--client-process",
        action="store_true",
        help="run the clients in a process of their own (as real clients are), not on the "
        "server's event loop",
    )
    args = p.parse_args()
    solo = {"auto": None, "on": True, "off": False}[args.solo_rows]
    rng = random.Random(0)
    rows = []
    ring = ring_options(args.vault, args.memory)
    async with Engine.open(args.vault, max_batch=args.max_batch, solo_rows=solo, **ring) as engine:
        if args.fill:
            from smoe.bench.resident import fill_ring

            await fill_ring(engine)
        vocab = engine.vault.manifest.shape.vocab_size
        eos = set(getattr(engine.tokenizer, "eos_token_ids", None) or [])
        words = [t for t in range(3, vocab) if t not in eos]
        loop = asyncio.get_running_loop()
        port = loop.create_future()
        options = ServerOptions(max_queue=64, prewarm_when_idle=False, cached_sequences=0)
        task = loop.create_task(serve(engine, "127.0.0.1", 0, options, ready=port.set_result))
        url = f"http://127.0.0.1:{await port}/v1/completions"
        clients = None
        if args.client_process:
            import concurrent.futures
            import multiprocessing

            spawn = multiprocessing.get_context("spawn")
            clients = concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn)

        async def round_(n: int, batch: int, prompts: list[list[int]]) -> dict:
            engine.debug.batcher.max_batch = batch
            sched = engine.debug.scheduler.stats
            bytes0, steps0, rows0 = (
                sched.bytes_read(),
                engine.debug.batcher.steps,
                engine.debug.batcher.step_rows,
            )
            engine.debug.runner.timeline.clear()
            if clients is None:
                seconds, results = await drive(url, prompts, args.max_tokens)
            else:
                seconds, results = await loop.run_in_executor(
                    clients, drive_in_process, url, prompts, args.max_tokens
                )
            tokens = sum(t for t, _, _ in results)
            steps = engine.debug.batcher.steps - steps0
            return {
                "clients": n,
                "max_batch": batch,
                "tokens": tokens,
                "seconds": round(seconds, 3),
                "total_tok_s": round(tokens / seconds, 2),
                "mean_ttft_s": round(sum(t for _, t, _ in results) / n, 3),
                "rows_per_step": round((engine.debug.batcher.step_rows - rows0) / max(steps, 1), 2),
                "mb_read_per_token": round((sched.bytes_read() - bytes0) / tokens / 1e6, 2),
                "steps": engine.stats().steps,
                "texts": [x for _, _, x in results],
            }

        text_ids = engine.encode(Path(args.text).read_text()) if args.text else []  # noqa: ASYNC240

        def fresh(n: int) -> list[list[int]]:
            if text_ids:  # real text: the routing a model sees in use
                starts = [rng.randrange(len(text_ids) - args.prompt_tokens) for _ in range(n)]
                return [text_ids[s : s + args.prompt_tokens] for s in starts]
            return [rng.choices(words, k=args.prompt_tokens) for _ in range(n)]

        # Warm-up, not reported: imports, first touch of the ring, kernel compilation (MLX
        # on CUDA compiles kernels at their first use, per shape).
        await round_(4, args.max_batch, fresh(4))
        await round_(1, 1, fresh(1))
        for i, n in enumerate(int(x) for x in args.clients.split(",")):
            order = (args.max_batch, 1) if i % 2 == 0 else (1, args.max_batch)
            prompts = fresh(n)
            got = {b: await round_(n, b, prompts) for b in order}
            batched, alone = got[args.max_batch], got[1]
            batched["vs_one_at_a_time"] = round(batched["total_tok_s"] / alone["total_tok_s"], 2)
            batched["same_text"] = batched.pop("texts") == alone.pop("texts")
            rows += [batched, alone]
            print(
                json.dumps(batched),
                json.dumps(alone),
                sep="\n",
                flush=True,
                file=sys.stderr,
            )
        if clients is not None:
            clients.shutdown()
        task.cancel()
        single = next(
            (r["total_tok_s"] for r in rows if r["clients"] == 1 and r["max_batch"] > 1), None
        )
        for r in rows:
            if r["max_batch"] > 1 and single is not None:
                r["vs_single_client"] = round(r["total_tok_s"] / single, 2)
        ring = {"slots": engine.debug.ring.num_slots, "experts": engine.vault.manifest.num_records}
        rules = None if engine.debug.runner.rules is None else engine.debug.runner.rules.measured
    harness.report(
        {
            "benchmark": "serve_clients",
            "vault": args.vault,
            "memory": args.memory,
            "ring": ring,
            "filled": args.fill,
            "kernel_rules": rules,
            "max_tokens": args.max_tokens,
            "prompt_tokens": args.prompt_tokens,
            "client_process": args.client_process,
            "runs": rows,
        },
        args,
    )


if __name__ == "__main__":
    smoe.util.loop.run(main())
