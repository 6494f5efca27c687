"""`smoe bench policy`, `tiers`, `locality` and `trace`: the routing research benchmarks,
over routing archives (recorded by `smoe generate --routing-archive`) or synthetic traces."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from smoe.util.provenance import stamp


def cmd_bench_policy(args: argparse.Namespace) -> int:
    from smoe.bench.policy import main as policy_main

    return policy_main(args.rest, prog="smoe bench policy")


def cmd_bench_tiers(args: argparse.Namespace) -> int:
    from smoe.bench.tiers import main as tiers_main

    return tiers_main(args.rest, prog="smoe bench tiers")


def cmd_bench_locality(args: argparse.Namespace) -> int:
    from smoe.bench.policy import bench_locality
    from smoe.telemetry.archive import RoutingArchive

    report = bench_locality(RoutingArchive.load(args.archive))
    print(json.dumps(stamp(report, args.argv), indent=1))
    print(json.dumps(report.get("headline", {})), file=sys.stderr)
    return 0


def cmd_bench_trace(args: argparse.Namespace) -> int:
    from smoe.telemetry.traces import preset_trace

    archive = preset_trace(args.preset, args.tokens, seed=args.seed, layers=args.layers)
    print(f"wrote {archive.save(args.out)}")
    return 0


def add_bench_routing(bsub: Any) -> None:
    """`smoe bench`: policy, locality and trace: routing research."""
    bp = bsub.add_parser(
        "policy",
        add_help=False,
        help="replay a routing archive or a synthetic trace against eviction "
        "policies and Belady's optimum (--help for options)",
    )
    # Its options are smoe.bench.policy's own: main() hands it what this parser does not know.
    bp.set_defaults(func=cmd_bench_policy, passthrough=True)
    bti = bsub.add_parser(
        "tiers",
        add_help=False,
        help="replay a routing archive through a two-level cache (GPU ring + host RAM) "
        "against Belady (--help for options)",
    )
    bti.set_defaults(func=cmd_bench_tiers, passthrough=True)
    bl = bsub.add_parser("locality", help="expert reuse between tokens, from a routing archive")
    bl.add_argument(
        "archive", type=Path, help="a routing archive (.npz, smoe generate --routing-archive)"
    )
    bl.set_defaults(func=cmd_bench_locality)
    bt = bsub.add_parser("trace", help="write a synthetic routing trace with published locality")
    bt.add_argument("out", type=Path, help="the archive (.npz) to write")
    bt.add_argument(
        "--preset",
        default="qwen3-235b-like",
        help="a preset of smoe.telemetry.traces (default qwen3-235b-like)",
    )
    bt.add_argument("--tokens", type=int, default=2000, help="tokens traced (default 2000)")
    bt.add_argument(
        "--layers",
        type=int,
        default=None,
        help="override the preset's layer count (default: the preset's)",
    )
    bt.add_argument("--seed", type=int, default=0, help="seed of the trace (default 0)")
    bt.set_defaults(func=cmd_bench_trace)
