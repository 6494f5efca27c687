"""Where a cold prompt's time goes under a memory cap: one run per case, each a fresh
process in a memory cgroup of its cap (swap off) after dropping the page cache, the same
fixed prompt; then mlx-lm's own prefill of the same weights in memory (no cap), in the
same run, as the compute-only bound.

Per case: time to first token and prefill tok/s (the engine's own figures), bytes read by
priority (demand, speculative) during the prompt, the CPU seconds each kind of thread
spent over the wall time (cores busy), and the prefill timeline: per chunk and MoE layer,
evaluating the routing (the layer's attention and router), waiting on reads, and the
expert matmuls; and for a call whose experts do not fit the ring, each wave's.

    python bench/prefill_timeline.py VAULT --case third:2.2e9:2100MB --case half:3.4e9:3300MB
                                     --case none:: [--lookahead on,off] [--prefill-chunk 64]
                                     [--max-tokens 4] [--layers-shown 3] [--no-reference]

A case is NAME:CAP:MEMORY (CAP in bytes, empty: no cgroup; MEMORY: the --memory given,
empty: the engine's default). Needs root and a memory controller for capped cases
(tests/cgroup.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import harness

from bench.capped_prompt import PROMPT  # the same text: the same tokens
from tests.cgroup import limited

REPO = harness.REPO


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of this process's live threads, summed by thread name
    (MLX's and the I/O pool's threads share names)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = defaultdict(float)
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip().rstrip("0123456789-_")
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out[name or "?"] += (int(fields[11]) + int(fields[12])) / tick
    return dict(out)


def timeline(calls: list[Any], first_layer: int, shown: int) -> dict[str, Any]:
    """Sum the prefill's MoE calls per chunk (a chunk starts at the first MoE layer);
    list the first ``shown`` layers of each chunk and every wave."""
    chunks: list[list[Any]] = []
    for c in calls:
        if c.layer == first_layer or not chunks:
            chunks.append([])
        chunks[-1].append(c)
    rows = []
    for chunk in chunks:
        route = sum(c.route_s for c in chunk)
        wait = sum(c.wait_s for c in chunk)
        total = sum(c.seconds for c in chunk)
        rows.append(
            {
                "tokens": chunk[0].tokens,
                "layers": len(chunk),
                "unique_experts": sum(c.unique_experts for c in chunk),
                "waves": sum(c.waves for c in chunk),
                "route_s": round(route, 3),
                "wait_s": round(wait, 3),
                "experts_s": round(total - route - wait, 3),
                "moe_calls_s": round(total, 3),
                "first_layers": [
                    {
                        "layer": c.layer,
                        "experts": c.unique_experts,
                        "in_ring": c.resident,
                        "route_s": round(c.route_s, 4),
                        "wait_s": round(c.wait_s, 4),
                        "experts_s": round(c.seconds - c.route_s - c.wait_s, 4),
                        "waves": [
                            [w.experts, round(w.wait_s, 4), round(w.compute_s, 4)]
                            for w in c.wave_times
                        ],
                    }
                    for c in chunk[:shown]
                ],
            }
        )
    return {"chunks": rows}


async def child(a: argparse.Namespace) -> dict[str, Any]:
    """One case, in this process: open the engine, run the prompt, report."""
    from smoe.engine import Engine

    options: dict[str, Any] = {
        "lookahead": a.lookahead == "on",
        "prefill_chunk": a.prefill_chunk,
        "max_context": a.max_context,
        "max_batch": 1,
    }
    start = time.perf_counter()
    async with Engine.open(a.vault, a.memory or None, **options) as engine:
        opened = time.perf_counter()
        ids = engine.tokenizer.encode(PROMPT)
        before_cpu, before_io = thread_cpu(), engine.stats().scheduler.to_json()
        t0 = time.perf_counter()
        stats, first_cpu, first_io, t_first = None, None, None, None
        async for ev in engine.generate(ids, max_tokens=a.max_tokens, stop_at_eos=False):
            if ev.token is not None and t_first is None:
                t_first = time.perf_counter()
                first_cpu, first_io = thread_cpu(), engine.stats().scheduler.to_json()
            if ev.stats is not None:
                stats = ev.stats
        assert stats is not None and first_cpu is not None and first_io is not None
        wall = t_first - t0
        busy = {k: round(v - before_cpu.get(k, 0.0), 2) for k, v in first_cpu.items()}
        prio = {
            p: first_io["by_priority"][p]["bytes"] - before_io["by_priority"][p]["bytes"]
            for p in first_io["by_priority"]
        }
        tracer = engine.debug.tracer
        calls = [c for c in tracer.counters.calls if c.phase == 0]
        ring = engine.stats().ring
        return {
            "open_s": round(opened - start, 2),
            "prompt_tokens": stats.prompt_tokens,
            "ttft_s": round(stats.ttft_s, 2),
            "prefill_tok_s": round(stats.prefill_tok_s, 3),
            "decode_tok_s": round(stats.decode_tok_s, 3),
            "ring_slots": ring.slots,
            "prefill_bytes_by_priority": prio,
            "prefill_cpu_s_by_thread": {k: v for k, v in sorted(busy.items()) if v > 0.05},
            "prefill_cores_busy": round(sum(busy.values()) / wall, 2),
            "prefill_wall_s": round(wall, 2),
            "timeline": timeline(calls, tracer.first_layer, a.layers_shown),
        }


def run_case(name: str, cap: str, memory: str, lookahead: str, a: argparse.Namespace) -> dict:
    argv = [sys.executable, __file__, a.vault, "--child", "--lookahead", lookahead]
    argv += ["--prefill-chunk", str(a.prefill_chunk), "--max-tokens", str(a.max_tokens)]
    argv += ["--max-context", str(a.max_context), "--layers-shown", str(a.layers_shown)]
    argv += ["--memory", memory]
    subprocess.run(["sync"], check=False)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    kw: dict[str, Any] = {"capture_output": True, "text": True, "cwd": str(REPO)}
    if cap:
        run = limited(argv, int(float(cap)), **kw)
        if run is None:
            raise SystemExit(
                "cannot create a memory cgroup here (needs root and a memory controller)"
            )
        result, kills = run.result, run.oom_kills
    else:
        result, kills = subprocess.run(argv, **kw), 0
    head = {"case": name, "cap": cap or None, "memory": memory or None, "lookahead": lookahead}
    if result.returncode != 0:
        return {
            **head,
            "exit": result.returncode,
            "oom_kills": kills,
            "error": result.stderr[-800:],
        }
    return {**head, "oom_kills": kills, **json.loads(result.stdout.strip().splitlines()[-1])}


def reference(a: argparse.Namespace, tokens: int) -> dict[str, Any]:
    """mlx-lm's own prefill of the same weights in memory (no cap), and the engine's with
    the whole model resident, as `smoe bench resident` measures them (one process)."""
    argv = ["smoe", "bench", "resident", a.vault, "--device", "cpu"]
    argv += ["--prompt-tokens", str(tokens), "--max-tokens", "4"]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=str(REPO))
    if r.returncode != 0:
        return {"exit": r.returncode, "error": r.stderr[-800:]}
    report = json.loads(r.stdout[r.stdout.index("{") :])
    keep = ("ttft_s", "prefill_tok_s", "decode_tok_s")
    return {
        "command": " ".join(argv),
        "mlx_lm": {k: report["mlx_lm"][k] for k in keep},
        "engine_resident": {k: report["engine"][k] for k in keep},
        "tokens_equal": report.get("tokens_equal"),
    }


def main() -> None:
    p = harness.parser(__doc__)
    harness.vault(p)
    p.add_argument("--case", action="append", default=[], help="NAME:CAP:MEMORY (repeatable)")
    p.add_argument("--lookahead", default="on", help="on, off, or on,off (each case both)")
    p.add_argument("--prefill-chunk", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--max-context", type=int, default=512)
    p.add_argument("--layers-shown", type=int, default=3, help="layers listed per chunk")
    p.add_argument("--no-reference", dest="reference", action="store_false")
    p.add_argument("--memory", default="", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(asyncio.run(child(a))))
        return
    runs = []
    for case in a.case or ["none::"]:
        name, cap, memory = (case.split(":") + ["", ""])[:3]
        for look in a.lookahead.split(","):
            runs.append(run_case(name, cap, memory, look, a))
            print(
                json.dumps(
                    {k: runs[-1].get(k) for k in ("case", "lookahead", "ttft_s", "prefill_tok_s")}
                ),
                file=sys.stderr,
                flush=True,
            )
    report: dict[str, Any] = {"benchmark": "prefill_timeline", "vault": a.vault, "runs": runs}
    tokens = next((r["prompt_tokens"] for r in runs if "prompt_tokens" in r), None)
    if a.reference and tokens:
        report["reference_in_memory"] = reference(a, tokens)
    harness.report(report, a)


if __name__ == "__main__":
    main()
