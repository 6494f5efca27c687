"""A restarted server and a repeated long system prompt: time to first token, cold and
from `--prefix-cache-dir`.

    python bench/prefix_restart.py VAULT [--system-tokens 2048] [--memory SIZE] [--rounds 1]

Each round, in fresh `smoe serve` processes (a real restart: nothing of the first in
memory), with a fresh directory:
  1. cold: a server with --prefix-cache-dir gets SYSTEM + QUESTION_1 (random ids), and
     writes its KV cache to the directory;
  2. restarted: a new server on the same directory gets SYSTEM + QUESTION_2;
  3. reference: a server without the directory gets SYSTEM + QUESTION_2 (cold again).
Each request is `/v1/completions` with prompt ids, greedy, 8 tokens, timed to its first
streamed token. Reports each time, restarted / cold, whether the restarted server's text
equals the reference's, and the store's counts (hits, reused tokens). Prints JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import harness
import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """`smoe serve VAULT` in a child process, until the block ends (SIGINT, then waited)."""

    def __init__(self, vault: str, memory: str | None, directory: Path | None) -> None:
        self.port = free_port()
        self.cmd = [sys.executable, "-m", "smoe.cli", "serve", vault, "--port", str(self.port)]
        self.cmd += ["--no-prewarm", "--no-warm-up"]
        if memory:
            self.cmd += ["--memory", memory]
        if directory is not None:
            self.cmd += ["--prefix-cache-dir", str(directory)]
        self.base = f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> Served:
        self.proc = await asyncio.create_subprocess_exec(
            *self.cmd, stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        assert self.proc.stderr is not None
        while True:  # "serving VAULT on http://..." once it listens
            line = (await self.proc.stderr.readline()).decode()
            if not line:
                raise SystemExit(f"the server exited ({await self.proc.wait()}): {self.cmd}")
            if line.startswith("serving "):
                break
        self.drain = asyncio.get_running_loop().create_task(self.proc.stderr.read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGINT)
        await self.proc.wait()
        await self.drain

    async def first_token(self, ids: list[int]) -> tuple[float, str]:
        """(seconds to the first streamed token, the 8 tokens' text)."""
        body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "stream": True}
        body["ignore_eos"] = True
        text, first = [], None
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            start = time.perf_counter()
            async with http.post(self.base + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        piece = json.loads(line[6:])["choices"][0]["text"]
                        if first is None:
                            first = time.perf_counter() - start
                        text.append(piece)
        assert first is not None
        return first, "".join(text)

    async def store(self) -> dict[str, Any]:
        async with (
            aiohttp.ClientSession() as http,
            http.get(self.base + "/v1/smoe/stats") as r,
        ):
            return (await r.json())["prefix_store"]  # type: ignore[no-any-return]

    async def written(self) -> dict[str, Any]:
        """The store's counts once its first write has landed."""
        while True:
            stats = await self.store()
            if stats["writes"] or stats["write_failures"]:
                return stats
            await asyncio.sleep(0.05)


async def one_round(args: Any, seed: int) -> dict[str, Any]:
    from smoe.vault.format import Vault

    vocab = Vault.open(args.vault).manifest.shape.vocab_size
    rng = np.random.default_rng(seed)
    system = [int(t) for t in rng.integers(10, vocab, args.system_tokens)]
    q1, q2 = ([int(t) for t in rng.integers(10, vocab, 24)] for _ in range(2))
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        directory = Path(d)
        async with Served(args.vault, args.memory, directory) as srv:
            cold, _ = await srv.first_token(system + q1)
            wrote = await srv.written()
        async with Served(args.vault, args.memory, directory) as srv:
            warm, text = await srv.first_token(system + q2)
            store = await srv.store()
        entry_bytes = sum([(await p.stat()).st_size async for p in anyio.Path(directory).iterdir()])
    async with Served(args.vault, args.memory, None) as srv:
        cold_again, want = await srv.first_token(system + q2)
    return {
        "cold_s": cold,
        "restarted_s": warm,
        "reference_cold_s": cold_again,
        "restarted_over_cold": warm / cold,
        "restarted_over_reference": warm / cold_again,
        "text_equal": text == want,
        "entry_bytes": entry_bytes,
        "writes": wrote["writes"],
        "hits": store["hits"],
        "reused_tokens": store["reused_tokens"],
    }


async def main() -> None:
    p = harness.parser(__doc__)
    harness.vault(p)
    p.add_argument("--system-tokens", type=int, default=2048)
    p.add_argument("--memory", default=None)
    p.add_argument("--dir", default=None, help="where the temporary store directories go")
    harness.rounds(p, default=1)
    args = p.parse_args()
    rounds = [await one_round(args, seed) for seed in range(args.rounds)]
    ratios = [r["restarted_over_cold"] for r in rounds]
    harness.report(
        {
            "system_tokens": args.system_tokens,
            "memory": args.memory,
            "rounds": rounds,
            "median_restarted_over_cold": statistics.median(ratios),
            "all_text_equal": all(r["text_equal"] for r in rounds),
        },
        args,
    )


if __name__ == "__main__":
    import smoe.util.loop

    smoe.util.loop.run(main())
