"""The same greedy chat request through `smoe serve`'s three APIs, measured in one run.

    python bench/serve_dialects.py VAULT [--rounds 6] [--max-tokens 32] [--ring SHARE]

Starts the server in-process on a free port and streams one chat request per API
(OpenAI /v1/chat/completions, Anthropic /v1/messages, Ollama /api/chat) over raw HTTP
(aiohttp), rotating which API goes first each round (ABC, BCA, CAB, ...). Prefix reuse is
off, so every request prefills its whole prompt. Prints JSON: per API the median time to
the first text and to the end (and the least time to the end), the tokens generated, and ``same_text``: whether every API
returned the same reply in every round (they must: the same prompt, greedy).
"""

import asyncio
import contextlib
import json
import statistics
import time
from pathlib import Path

import aiohttp
import harness

import smoe.util.loop
from smoe.bench.generate import ring_options
from smoe.engine import Engine
from smoe.serve.app import ServerOptions, serve

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Tell me about the beginning of all things."},
]


def requests(max_tokens: int) -> dict[str, tuple[str, dict]]:
    """Each API's path and body for the same greedy chat."""
    return {
        "openai": (
            "/v1/chat/completions",
            {"messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "stream": True},
        ),
        "anthropic": (
            "/v1/messages",
            {
                "system": MESSAGES[0]["content"],
                "messages": MESSAGES[1:],
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
            },
        ),
        "ollama": (
            "/api/chat",
            {"messages": MESSAGES, "options": {"temperature": 0, "num_predict": max_tokens}},
        ),
    }


def text_of(api: str, line: bytes) -> str:
    """The reply text one streamed line carries, in ``api``'s framing."""
    if api == "ollama":
        return json.loads(line)["message"]["content"] if line.strip() else ""
    if not line.startswith(b"data: {"):
        return ""
    data = json.loads(line[6:])
    if api == "openai":
        return "".join(c["delta"].get("content") or "" for c in data["choices"])
    delta = data.get("delta", {})
    return delta.get("text", "") if data["type"] == "content_block_delta" else ""


async def main() -> None:
    p = harness.parser(__doc__)
    harness.vault(p)
    harness.rounds(p, default=6)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ring", default=None, help="ring size: a share of the experts, all, a size")
    args = p.parse_args()
    async with Engine.open(args.vault, **ring_options(args.vault, args.ring)) as engine:
        loop = asyncio.get_running_loop()
        port = loop.create_future()
        options = ServerOptions(prewarm_when_idle=False, cached_sequences=0)
        task = loop.create_task(serve(engine, "127.0.0.1", 0, options, ready=port.set_result))
        base = f"http://127.0.0.1:{await port}"
        bodies = requests(args.max_tokens)
        apis = list(bodies)
        times: dict[str, list[tuple[float, float]]] = {a: [] for a in apis}
        texts: set[str] = set()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
            for r in range(args.rounds + 1):  # round 0 warms up, unmeasured
                order = apis[r % 3 :] + apis[: r % 3]
                for api in order:
                    path, body = bodies[api]
                    start, first, text = time.perf_counter(), None, []
                    async with http.post(base + path, json=body) as resp:
                        resp.raise_for_status()
                        async for line in resp.content:
                            piece = text_of(api, line)
                            if piece and first is None:
                                first = time.perf_counter() - start
                            text.append(piece)
                    if r:
                        times[api].append((first or 0.0, time.perf_counter() - start))
                        texts.add("".join(text))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    result = {
        "vault": str(Path(args.vault)),
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "same_text": len(texts) == 1,
        "reply_chars": len(next(iter(texts))) if texts else 0,
        "apis": {
            api: {
                "median_ttft_s": round(statistics.median(t[0] for t in times[api]), 4),
                "median_total_s": round(statistics.median(t[1] for t in times[api]), 4),
                "min_total_s": round(min(t[1] for t in times[api]), 4),
            }
            for api in apis
        },
    }
    harness.report(result, args)


if __name__ == "__main__":
    smoe.util.loop.run(main())
