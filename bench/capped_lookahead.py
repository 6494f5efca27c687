"""Lookahead reads under a memory cap: a cold prompt and a decode inside a memory cgroup,
with the next layer's lookahead on and off, at each cap given (and with none), page cache
dropped before each run (JSON out). Per run: decode tok/s, demand and speculative bytes per
decoded token (read during decode), speculative reads used, and time to first token.

    python bench/capped_lookahead.py VAULT --cap 2.2e9:2100MB --cap 3.4e9:3300MB --cap none
                                     [--max-tokens 32] [--max-context 512]

``--cap LIMIT:MEMORY`` runs in a cgroup of LIMIT bytes with --memory MEMORY; ``none`` runs
uncapped with the engine's default budget. Needs root and a memory controller.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import harness

from tests.cgroup import limited  # the tests' cgroup helper

REPO = harness.REPO

PROMPT = (
    "In the beginning God created the heaven and the earth. And the earth was without form, "
    "and void; and darkness was upon the face of the deep."
)
# In the cgroup: one engine, the prompt's prefill and first token, then the decode, with
# the scheduler's counters read between the two (so decode's reads are told apart).
RUN = """
import json, sys, time
from smoe.engine import Engine
from smoe.util.loop import run

vault, memory, lookahead, max_tokens, context = sys.argv[1:6]

async def main():
    opts = dict(lookahead=lookahead == "1", max_context=int(context), max_batch=1)
    async with Engine.open(vault, memory=None if memory == "none" else memory, **opts) as e:
        ids = e.encode(sys.argv[6])
        first = None
        before = None
        start = time.perf_counter()
        n = 0
        async for ev in e.generate(ids, max_tokens=int(max_tokens), stop_at_eos=False):
            if ev.token is not None:
                n += 1
                if first is None:
                    first = time.perf_counter()
                    before = e.stats().scheduler.to_json()
        end = time.perf_counter()
        after = e.stats().scheduler.to_json()
    def prio(s, p):
        return s["by_priority"][p]
    steps = max(1, n - 1)
    print(json.dumps({
        "ttft_s": first - start,
        "decode_tok_s": steps / (end - first),
        "decode_demand_MB_per_token": (prio(after, "demand")["bytes"] - prio(before, "demand")["bytes"]) / steps / 1e6,
        "decode_speculative_MB_per_token": (prio(after, "speculative")["bytes"] - prio(before, "speculative")["bytes"]) / steps / 1e6,
        "decode_speculative_reads": prio(after, "speculative")["reads"] - prio(before, "speculative")["reads"],
        "decode_speculative_used": after["speculative_used"] - before["speculative_used"],
        "prefill_speculative_MB": prio(before, "speculative")["bytes"] / 1e6,
        "total_GB": after["bytes_read"] / 1e9,
    }))

run(main())
"""


def one(vault: str, cap: str, lookahead: bool, a: argparse.Namespace) -> dict:
    limit, memory = (None, "none") if cap == "none" else cap.split(":")
    argv = [sys.executable, "-c", RUN, vault, memory, "1" if lookahead else "0"]
    argv += [str(a.max_tokens), str(a.max_context), PROMPT]
    subprocess.run(["sync"], check=False)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if limit is None:
        r = subprocess.run(argv, capture_output=True, text=True, env=env)
        oom = 0
    else:
        run = limited(argv, int(float(limit)), capture_output=True, text=True, env=env)
        if run is None:
            raise SystemExit(
                "cannot create a memory cgroup here (needs root and a memory controller)"
            )
        r, oom = run.result, run.oom_kills
    row = {"cap": cap, "lookahead": lookahead, "exit": r.returncode, "oom_kills": oom}
    if r.returncode != 0:
        return {**row, "error": r.stderr[-800:]}
    return {**row, **json.loads(r.stdout.strip().splitlines()[-1])}


def main() -> None:
    p = harness.parser(__doc__)
    harness.vault(p)
    p.add_argument("--cap", action="append", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-context", type=int, default=512)
    a = p.parse_args()
    rows = []
    for cap in a.cap:
        for lookahead in (True, False):
            rows.append(one(a.vault, cap, lookahead, a))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    harness.report({"benchmark": "capped_lookahead", "vault": a.vault, "runs": rows}, a)


if __name__ == "__main__":
    main()
