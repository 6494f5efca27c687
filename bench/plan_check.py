"""Check `smoe plan`'s forecast against the engine: for each vault and budget, `smoe plan`
(disk and compute probed afresh), then an engine with the same whole-process --memory
measures steady decode and prefill tok/s, then the compute is probed again. Reported: the
plan's own band, and the band over both probes (which brackets the machine's load during
the measurement), against each measured request. Prints JSON.

    python bench/plan_check.py VAULT --memory 360MB,362MB,370MB [--device gpu]
        [--tokens 24] [--repeats 3] [--workers 4] [--chunks 2]
    python bench/plan_check.py --table A.json B.json     # saved reports as a markdown table

Steady state: the ring is warmed by a first request (or filled, when it holds every expert)
before the measured ones; the cold fill is forecast separately. Each measured request has
a prompt of ``--chunks`` prefill chunks (random ids) and decodes ``tokens`` tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import harness

from smoe.bench.generate import random_prompt
from smoe.bench.resident import fill_ring
from smoe.engine import Engine
from smoe.forecast.planner import PlanOptions, make_plan, open_subject
from smoe.forecast.probe import probe_compute
from smoe.forecast.speed import forecast, routing_probabilities
from smoe.vault.format import Vault


def _inside(value: float, band: list[float]) -> bool:
    return band[0] <= value <= band[1]


async def measure(
    vault: Vault, memory: str, args: argparse.Namespace, repeats: int
) -> dict[str, Any]:
    """Steady decode/prefill tok/s of an engine at ``memory`` (whole process, one sequence)."""
    runs = []
    tokens = args.tokens
    options: dict[str, Any] = {"device": args.device, "workers": args.workers, "max_batch": 1}
    async with Engine.open(vault.path, memory=memory, **options) as engine:
        assert engine.plan.ring.fit is not None
        chunk = engine.options.prefill_chunk
        if engine.debug.ring.num_slots >= vault.manifest.num_records:
            await fill_ring(engine)
        for i in range(repeats + 1):  # the first warms the ring and compiles kernels
            prompt = random_prompt(vault, args.chunks * chunk + 1, seed=100 + i)
            stats = None
            async for ev in engine.generate(prompt, max_tokens=tokens + 1, stop_at_eos=False):
                stats = ev.stats or stats
            if i and stats is not None:
                runs.append(
                    {
                        "decode_tok_s": round(stats.decode_tok_s, 3),
                        "prefill_tok_s": round(stats.prefill_tok_s, 2),
                        "decode_hit_rate": round(stats.decode_hit_rate, 4),
                        "MB_per_token": round(stats.decode_bytes_per_token / 1e6, 3),
                    }
                )
        slots = engine.debug.ring.num_slots
    return {"ring_slots": slots, "runs": runs}


async def check(args: argparse.Namespace) -> dict[str, Any]:
    vault = Vault.open(args.vault)
    rows = []
    for memory in args.memory.split(","):
        # Compute probed afresh right before each measurement: the same load on the machine.
        options = PlanOptions(
            memory=memory,
            device=args.device,
            max_batch=1,
            workers=args.workers,
            fresh=True,
            probe_requests=args.repeats + 1,
            probe_chunks=args.chunks,
        )
        plan = await make_plan(vault.path, options)
        if not plan["fits"]:
            rows.append({"memory": memory, "fits": False, "why": plan["why"]})
            continue
        got = await measure(vault, memory, args, args.repeats)
        # A second compute probe after the measurement: the band of the two brackets the
        # machine's load during it (this machine is shared; the plan's own band is kept too).
        after = await probe_compute(
            vault,
            device=plan["device"],
            dtype=plan["dtype"],
            disk_gbps=plan["disk"]["gbps"],
            slots=got["ring_slots"],
            workers=args.workers,
            requests=args.repeats + 1,
            chunks=args.chunks,
        )
        keys = ("decode_s", "prefill_token_s", "decode_hit_rate", "decode_reads_per_token")
        keys += ("prefill_reads_per_chunk",)
        both = {key: plan["compute"].get(key, []) + after.get(key, []) for key in keys}
        subject = open_subject(vault.path, None)
        q, _ = routing_probabilities(subject.shape, subject.popularity)
        f = forecast(subject.shape, got["ring_slots"], q, plan["disk"], both, 64, args.workers)
        row = {
            "memory": memory,
            "ring_slots_plan": plan["fit"]["ring_slots"],
            "ring_slots_engine": got["ring_slots"],
            "ring_share": plan["fit"]["ring_share_of_experts"],
            "plan_decode_tok_s": plan["forecast"]["decode_tok_s"],
            "plan_prefill_tok_s": plan["forecast"]["prefill_tok_s"],
            "forecast_decode_tok_s": f["decode_tok_s"],
            "forecast_prefill_tok_s": f["prefill_tok_s"],
            "forecast_hit_rate": f["hit_rate"],
            "forecast_MB_per_token": f["MB_per_token"],
            "compute_probe_decode_ms": [round(1000 * x, 2) for x in both["decode_s"]],
            "disk_gbps": [plan["disk"][k] for k in ("gbps_low", "gbps", "gbps_high")],
            "measured": got["runs"],
            "load_average_1min": round(os.getloadavg()[0], 2),  # other work on this machine
            "plan_decode_inside": all(
                _inside(r["decode_tok_s"], plan["forecast"]["decode_tok_s"]) for r in got["runs"]
            ),
            "decode_inside": all(
                _inside(r["decode_tok_s"], f["decode_tok_s"]) for r in got["runs"]
            ),
            "prefill_inside": all(
                _inside(r["prefill_tok_s"], f["prefill_tok_s"]) for r in got["runs"]
            ),
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return {
        "benchmark": "plan_check",
        "vault": str(vault.path),
        "device": args.device or "default",
        "disk": plan.get("disk"),
        "compute": plan.get("compute"),
        "routing": plan.get("routing"),
        "tokens": args.tokens,
        "repeats": args.repeats,
        "chunks": args.chunks,
        "rows": rows,
    }


def table(reports: list[dict[str, Any]]) -> str:
    """Markdown rows (vault, budget, ring, forecast bands, measured) of saved reports."""
    out = [
        "| vault | --memory | ring | decode forecast (plan / both probes) | decode measured "
        "| prefill forecast (both probes) | prefill measured | MB/token forecast / measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for report in reports:
        name = Path(report["vault"]).name
        for r in report["rows"]:
            if not r.get("measured"):
                continue
            dec = ", ".join(f"{x['decode_tok_s']:g}" for x in r["measured"])
            pre = ", ".join(f"{x['prefill_tok_s']:g}" for x in r["measured"])
            mb = ", ".join(f"{x['MB_per_token']:g}" for x in r["measured"])
            band = "{:g}-{:g}".format
            out.append(
                f"| {name} | {r['memory']} | {r['ring_slots_engine']} "
                f"({100 * r['ring_share']:.0f}%) | {band(*r['plan_decode_tok_s'])} / "
                f"{band(*r['forecast_decode_tok_s'])} | {dec} "
                f"{'in' if r['decode_inside'] else 'OUT'} | {band(*r['forecast_prefill_tok_s'])}"
                f" | {pre} {'in' if r['prefill_inside'] else 'OUT'} | "
                f"{band(*r['forecast_MB_per_token'])} / {mb} |"
            )
    return "\n".join(out)


def main() -> None:
    if sys.argv[1:2] == ["--table"]:  # render saved reports: --table A.json B.json
        print(table([json.loads(Path(p).read_text()) for p in sys.argv[2:]]))
        return
    p = harness.parser(__doc__)
    harness.vault(p, type=Path)
    harness.memory(p, required=True, metavar="M1,M2,...")
    harness.device(p)
    p.add_argument("--tokens", type=int, default=24, help="decoded tokens per measured request")
    p.add_argument("--repeats", type=int, default=3, help="measured requests per budget")
    harness.workers(p, default=4)
    p.add_argument("--chunks", type=int, default=2, help="prefill chunks per prompt (all runs)")
    args = p.parse_args()
    harness.report(asyncio.run(check(args)), args)


if __name__ == "__main__":
    main()
