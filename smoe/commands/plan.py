"""`smoe plan SRC_OR_VAULT [--memory X]`: whether a model fits a memory budget and how fast
it will run there, before loading it (smoe.forecast.planner; docs/plan.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from smoe.commands.options import add_device, add_dtype, add_host_memory, add_workers, size_arg
from smoe.plan.budget import KV_BITS


def cmd_plan(args: argparse.Namespace) -> int:
    from smoe.forecast.planner import PlanOptions, make_plan
    from smoe.util.loop import run

    options = PlanOptions(
        memory=args.memory,
        host_memory=args.host_memory,
        device=args.device,
        dtype=args.dtype,
        context=args.context,
        kv_bits=args.kv_bits,
        max_batch=args.max_batch,
        workers=args.workers,
        bits=args.bits,
        probe_seconds=args.probe_seconds,
        fresh=args.fresh,
        compute=not args.no_compute,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    from smoe.vault.hub import resolve_model

    model = resolve_model(args.model, offers_download=False)  # a folder, or a Hub name
    plan = run(make_plan(model, options))
    print(json.dumps(plan, indent=1) if args.json else render(plan))
    return 0 if plan["fits"] else 1  # a script can tell a budget that does not fit


KINDS = {
    "vault": "vault",
    "source": "source, run as it is",
    "converted": "source, as `smoe convert --bits` would make it",
}


def _band(pair: list[float], unit: str) -> str:
    return f"{pair[0]:g} - {pair[1]:g} {unit}"


def render(plan: dict[str, Any]) -> str:
    """The plan as a human table."""
    from smoe.util.sizes import format_bytes

    e = plan["experts"]
    slot, record = format_bytes(e["slot_bytes"]), format_bytes(e["record_bytes"])
    # The slot is what the ring allocates per expert (all_bytes is records x it); a staged
    # ring's holds the record in the compute dtype, so it may differ from the record on disk.
    each = f"{slot} each" if slot == record else f"{slot} a slot ({record} a record on disk)"
    rows = [
        ("model", f"{plan['model']} ({KINDS[plan['kind']]})"),
        ("device", f"{plan['device']}, {plan['dtype']}, {plan['ring']} ring"),
        (
            "experts",
            f"{e['records']} = {e['moe_layers']} layers x {e['per_layer']} (top-{e['top_k']}), "
            f"{each}, {format_bytes(e['all_bytes'])} in all",
        ),
        (
            "smallest memory",
            f"{plan['smallest_memory']} (at a {plan['smallest_memory_context']}-token context)",
        ),
        (
            "every expert",
            f"{plan['memory_for_every_expert']} (at a {plan['every_expert_context']}-token "
            "context)",
        ),
        ("context limit", f"{plan['context_limit']} tokens at this budget"),
    ]
    if not plan["fits"]:
        rows.append(("fit", f"does not fit: smallest budget {plan['smallest_memory']}"))
        return _table(rows)
    rows.append(("fit", plan["line"]))
    if plan["host_tier"]["images"]:  # misses it holds come over the bus, not from the disk
        rows.append(("host tier", plan["host_tier"]["line"] + " (the forecast reads them)"))
    pp = plan["prompt_pass"]
    rows.append(
        (
            "prompt pass",
            f"up to {pp['tokens']} tokens a pass, each layer's experts read once a pass "
            f"({format_bytes(pp['bytes'])} of activations, in working)"
            if pp["layer_major"]
            else "chunk by chunk (this architecture is not known to allow layer-major)",
        )
    )
    d = plan["disk"]
    cached = " (cached)" if d.get("cached") else ""
    rows.append(
        (
            "disk",
            f"{d['gbps']:g} GB/s (low {d['gbps_low']:g}, high {d['gbps_high']:g}){cached}",
        )
    )
    rows.append(("routing", plan["routing"]))
    c = plan["compute"]
    if c is not None:
        how = "recorded" if c.get("recorded") else "measured"
        ms = [round(1000 * x, 2) for x in c["decode_s"]]
        rows.append(("compute", f"{ms} ms per decode token ({how})"))
    f = plan.get("forecast")
    if f is not None:
        rows += [
            ("hit rate", _band([round(100 * h, 1) for h in f["hit_rate"]], "%")),
            ("reads / token", _band(f["reads_per_token"], f"({_band(f['MB_per_token'], 'MB')})")),
            ("decode", _band(f["decode_tok_s"], "tok/s")),
            ("prefill", _band(f["prefill_tok_s"], "tok/s")),
            ("cold fill", _band(f["cold_fill_s"], "s")),
        ]
    else:
        rows.append(("speed", plan.get("why_no_speed", "")))
        rows.append(("cold fill", f"{plan['cold_fill_s']} s"))
    return _table(rows)


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def add_plan(sub: Any) -> None:
    """`smoe plan` and its options."""
    p = sub.add_parser(
        "plan",
        help="whether a model fits a memory budget, and its speed there, before loading it",
    )
    p.add_argument("model", type=Path, help="a vault, or a Hugging Face / MLX checkpoint folder")
    p.add_argument(
        "--memory",
        type=size_arg,
        default=None,
        help="the whole process's budget, e.g. 8GB (default: the engine's default budget)",
    )
    add_host_memory(p)
    add_device(p)
    add_dtype(p)
    p.add_argument(
        "-c",
        "--max-context",
        "--context",
        "--ctx-size",
        dest="context",
        type=int,
        default=None,
        help="tokens the KV caches hold (default 4096, or the model's maximum if smaller; "
        "with --memory, halved down to 512 until it fits: as the run commands)",
    )
    p.add_argument(
        "--kv-bits",
        type=int,
        choices=KV_BITS,
        default=None,
        help="quantized KV cache, as the run commands' (default: off, the model's dtype)",
    )
    p.add_argument(
        "--max-batch", type=int, default=1, help="sequences decoded together (default 1)"
    )
    add_workers(p)
    p.add_argument(
        "--bits",
        type=int,
        default=None,
        help="a source folder: plan the vault `smoe convert --bits N` would make (default: "
        "the folder run as it is, as `smoe generate` runs it)",
    )
    p.add_argument("--probe-seconds", type=float, default=3.0, help="disk probe length (default 3)")
    p.add_argument(
        "--fresh", action="store_true", help="measure disk and compute again (not cached)"
    )
    p.add_argument(
        "--no-compute", action="store_true", help="skip the compute probe (no speed band)"
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_plan)
