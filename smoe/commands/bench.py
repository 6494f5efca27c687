"""`smoe bench ...`: every benchmark subcommand and its parser. Each prints its report as
JSON on stdout and a short summary on stderr; the measuring is in smoe.bench."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from smoe.commands.bench_routing import add_bench_routing
from smoe.commands.options import add_device
from smoe.errors import SmoeError
from smoe.util.provenance import stamp


def _int_list(text: str, minimum: int = 1) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4, got '{text}'") from None
    if not values or min(values) < minimum:
        raise argparse.ArgumentTypeError(f"expected numbers >= {minimum} like 1,2,4")
    return values


def _count_list(text: str) -> list[int]:
    return _int_list(text, minimum=0)


def _parts_list(text: str) -> list[int | None]:
    """'auto,1,4' -> [None, 1, 4] (None: auto); SmoeError for anything else."""
    out: list[int | None] = []
    for item in text.split(","):
        if item == "auto":
            out.append(None)
        elif item.isdigit() and int(item) >= 1:
            out.append(int(item))
        else:
            raise SmoeError(f"--parts takes auto or counts >= 1, e.g. auto,1 (got {item!r})")
    return out


def cmd_bench_io(args: argparse.Namespace) -> int:
    from smoe.bench.io import bench_io

    report = bench_io(
        args.vault,
        args.workers,
        reads=args.reads,
        repeats=args.repeats,
        batch=args.batch,
        slots=args.slots,
        seed=args.seed,
        paths=tuple(args.path.split(",")),
        busy=tuple(args.busy),
        parts=tuple(_parts_list(args.parts)),
        verify=not args.no_verify,
        control=args.control,
    )
    if args.host_tier:  # copies up from host images beside the disk's reads
        from smoe.bench.decode import bus_bandwidth
        from smoe.util.loop import run
        from smoe.vault.format import Vault

        bus, image = run(bus_bandwidth(Vault.open(args.vault), device=args.device))
        disk = max(r["baseline_GBps"] for r in report["sweep"])
        report["host_tier"] = {
            "bus_GBps": round(bus, 3),
            "image_bytes": image,
            "best_disk_GBps": disk,
            "bus_over_disk": round(bus / disk, 2),
        }
    print(json.dumps(stamp(report, args.argv), indent=1))
    if args.host_tier:
        t = report["host_tier"]
        print(
            f"host tier: copies up {t['bus_GBps']:.2f} GB/s, {t['bus_over_disk']:.1f}x the "
            f"disk's best {t['best_disk_GBps']:.2f} GB/s",
            file=sys.stderr,
        )
    for row in report["sweep"]:
        print(
            f"{row['path']:>8} busy {row['busy_processes']:>2} parts {row['read_parts']} "
            f"workers {row['workers']:>3}: "
            f"baseline {row['baseline_GBps']:.2f} GB/s, "
            f"streamer {row['streamer_GBps']:.2f} GB/s ({100 * row['ratio']:.0f}%)"
            + (f", control {100 * row['control_ratio']:.0f}%" if "control_ratio" in row else ""),
            file=sys.stderr,
        )
    return 0


def cmd_bench_generate(args: argparse.Namespace) -> int:
    from smoe.bench.generate import bench_generate
    from smoe.util.loop import run
    from smoe.util.sizes import format_bytes

    report = run(
        bench_generate(
            str(args.vault),
            args.budgets.split(","),
            prompt_tokens=args.prompt_tokens,
            max_tokens=args.max_tokens,
            workers=args.workers,
            seed=args.seed,
        )
    )
    print(json.dumps(stamp(report, args.argv), indent=1))
    for r in report["runs"]:
        print(
            f"{r['budget']:>6} ({r['ring_slots']} slots): first token {r['ttft_s']:.2f} s, "
            f"prefill {r['prefill_tok_s']:.1f} tok/s, decode {r['decode_tok_s']:.2f} tok/s, "
            f"decode hit {100 * r['decode_hit_rate']:.0f}%, "
            f"{format_bytes(r['decode_bytes_per_token'])}/token, "
            f"I/O wait {100 * r['decode_io_wait_share']:.0f}% of decode",
            file=sys.stderr,
        )
    return 0


def cmd_bench_resident(args: argparse.Namespace) -> int:
    from smoe.bench.resident import bench_resident
    from smoe.util.loop import run

    report = run(
        bench_resident(
            str(args.vault),
            prompt_tokens=args.prompt_tokens,
            max_tokens=args.max_tokens,
            chunk=args.prefill_chunk,
            seed=args.seed,
            device=args.device,
            ring=args.ring,
        )
    )
    print(json.dumps(stamp(report, args.argv), indent=1))
    e, r = report["engine"], report["mlx_lm"]
    print(
        f"decode {e['decode_tok_s']:.1f} vs mlx-lm {r['decode_tok_s']:.1f} tok/s "
        f"({report['decode_ratio']:.2f}x); prefill {e['prefill_tok_s']:.1f} vs "
        f"{r['prefill_tok_s']:.1f} tok/s ({report['prefill_ratio']:.2f}x); "
        f"tokens equal: {report['tokens_equal']}",
        file=sys.stderr,
    )
    return 0


def cmd_bench_limits(args: argparse.Namespace) -> int:
    """`smoe bench decode` and `smoe bench prefill` (args.bench says which)."""
    from smoe.util.sizes import format_bytes

    report = _measure_limits(args)
    if args.plot and args.bench == "decode":
        from smoe.bench.plots import plot_time_breakdown

        plot_time_breakdown(report["runs"], args.plot)
        report["plot"] = str(args.plot)
    print(json.dumps(stamp(report, args.argv), indent=1))
    for r in report["runs"]:
        if args.bench == "decode":
            print(
                f"{r['budget']:>6} ({r['ring_slots']} slots): {r['decode_tok_s']:.2f} tok/s, "
                f"{1e3 * r['time_per_token_s']:.1f} ms/token vs limit "
                f"{1e3 * r['physical_limit_s']:.1f} ms ({r['ratio_to_limit']:.2f}x); "
                f"hit {100 * r['decode_hit_rate']:.0f}%, {format_bytes(r['bytes_per_token'])}/token"
                + (
                    f"; host tier {r['host_tier']}: "
                    f"{format_bytes(int(r['bus_MB_per_token'] * 1e6))}/token over the bus"
                    if "host_tier" in r
                    else ""
                ),
                file=sys.stderr,
            )
        else:
            print(
                f"{r['prompt_tokens']:>6} tokens, {r['budget']:>6} ({r['ring_slots']} slots), "
                f"{r['schedule']}: first token {r['ttft_s']:.2f} s, "
                f"{r['prefill_tok_s']:.1f} tok/s, read {format_bytes(r['prefill_bytes'])} "
                f"({r['bytes_over_union']:.2f}x the prompt's per-layer unions)",
                file=sys.stderr,
            )
    return 0


def parse_count(text: str, flag: str) -> int:
    """A positive whole number from a comma list, or SmoeError naming the flag."""
    if not text.strip().isdigit() or int(text) < 1:
        raise SmoeError(f"{flag}: {text!r} is not a positive whole number; e.g. {flag} 1024,4096")
    return int(text)


def _measure_limits(args: argparse.Namespace) -> dict[str, Any]:
    """The report of smoe.bench.decode's bench_decode or bench_prefill, per args.bench."""
    from smoe.bench.decode import bench_decode, bench_prefill
    from smoe.util.loop import run

    budgets = args.budgets.split(",")
    if args.bench == "decode":
        return run(
            bench_decode(
                str(args.vault),
                budgets,
                prompt_tokens=args.prompt_tokens,
                max_tokens=args.max_tokens,
                workers=args.workers,
                seed=args.seed,
                spec=args.spec,
                lookahead=args.lookahead,
                device=args.device,
                ring=args.ring,
                read_parts=args.read_parts,
                host_tiers=args.host_tiers.split(",") if args.host_tiers else None,
            )
        )
    lengths = args.lengths or str(args.prompt_tokens)
    schedules = args.schedules.split(",")
    if not schedules or set(schedules) - {"layer", "chunk"}:
        raise SmoeError(f"--schedules {args.schedules}: use layer, chunk or layer,chunk")
    return run(
        bench_prefill(
            str(args.vault),
            budgets,
            prompt_tokens=[parse_count(n, "--lengths") for n in lengths.split(",")],
            schedules=schedules,
            workers=args.workers,
            seed=args.seed,
            device=args.device,
            ring=args.ring,
        )
    )


def add_bench(sub: Any) -> None:
    """`smoe bench ...`: every benchmark and its options."""
    b = sub.add_parser("bench", help="benchmarks (JSON on stdout, a summary on stderr)")
    bsub = b.add_subparsers(dest="bench", required=True, metavar="BENCH")
    _add_bench_io(bsub)
    _add_bench_generate(bsub)
    _add_bench_limits(bsub)
    _add_bench_resident(bsub)
    add_bench_routing(bsub)


def _bench_seed(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--seed", type=int, default=0, help=f"seed of {what} (default 0)")


def _bench_tokens(p: argparse.ArgumentParser, prompt: int, reply: int) -> None:
    """--prompt-tokens and --max-tokens, with this benchmark's defaults."""
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=prompt,
        help=f"tokens of the random prompt (default {prompt})",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=reply,
        help=f"tokens decoded, where the benchmark decodes (default {reply})",
    )


def _bench_device(p: argparse.ArgumentParser) -> None:
    """--device and --ring, as the run commands take them."""
    add_device(p)
    p.add_argument(
        "--ring",
        choices=("auto", "unified", "staged"),
        default="auto",
        help="where reads land, as in `smoe generate` (default auto)",
    )


def _add_bench_io(bsub: Any) -> None:
    """`smoe bench`: reads: the streamer against raw O_DIRECT."""
    bio = bsub.add_parser("io", help="streamer read throughput vs a raw O_DIRECT baseline")
    bio.add_argument("vault", type=Path, help="the vault whose records are read")
    bio.add_argument(
        "--workers",
        type=_int_list,
        default=[1, 2, 4, 8, 16],
        help="worker counts to sweep (default 1,2,4,8,16)",
    )
    bio.add_argument(
        "--reads", type=int, default=None, help="records read per run (default: every record once)"
    )
    bio.add_argument(
        "--repeats",
        type=int,
        default=4,
        help="runs of each kind per worker count, in ABBA order (default 4)",
    )
    bio.add_argument(
        "--batch", type=int, default=8, help="experts per acquire, as a top-k (default 8)"
    )
    bio.add_argument(
        "--slots", type=int, default=64, help="ring slots for the streamer (default 64)"
    )
    bio.add_argument(
        "--path",
        default="unified",
        help="rings to measure: unified (reads land in the slots), staged (disk -> host "
        "landing -> device arrays), or both: unified,staged (default unified)",
    )
    bio.add_argument(
        "--busy",
        type=_count_list,
        default=[0],
        help="spinning processes beside the reads, e.g. 0,16 (default 0)",
    )
    bio.add_argument(
        "--parts",
        default="auto",
        help="parts the streamer reads each record in, e.g. auto,1 (default auto: one per "
        "2 MB, at most 4)",
    )
    bio.add_argument(
        "--no-verify",
        action="store_true",
        help="do not check each record's checksum as it is read (only to measure what "
        "checking costs: the engine always checks)",
    )
    bio.add_argument(
        "--control",
        action="store_true",
        help="also time a second baseline per repeat: control_ratio (baseline / baseline) is "
        "how far two identical runs differ on this disk, the noise floor of ratio",
    )
    bio.add_argument(
        "--host-tier",
        action="store_true",
        help="also time copies up from host-tier images into a staged ring (the bus a "
        "host tier's hits take: host -> GPU on CUDA) against the disk's best rate",
    )
    add_device(bio)
    _bench_seed(bio, "the records' order")
    bio.set_defaults(func=cmd_bench_io)


def _add_bench_generate(bsub: Any) -> None:
    """`smoe bench`: prefill and decode at several budgets."""
    bg = bsub.add_parser("generate", help="prefill and decode at several memory budgets")
    bg.add_argument("vault", type=Path, help="the vault to run")
    bg.add_argument(
        "--budgets",
        default="min,half,all",
        help="comma list of min, half, all or sizes like 2GB (default min,half,all)",
    )
    _bench_tokens(bg, prompt=128, reply=32)
    bg.add_argument("--workers", type=int, default=4, help="I/O threads (default 4)")
    _bench_seed(bg, "the random prompt")
    bg.set_defaults(func=cmd_bench_generate)


def _add_bench_limits(bsub: Any) -> None:
    """`smoe bench`: decode and prefill against their physical limits."""
    for name, prompt_default, doc in (
        ("decode", 16, "decode tok/s, bytes/token, I/O wait, vs the physical limit"),
        ("prefill", 256, "time to first token and prefill tok/s of a long prompt"),
    ):
        bd = bsub.add_parser(name, help=doc)
        bd.add_argument("vault", type=Path, help="the vault to run")
        bd.add_argument(
            "--budgets",
            default="min,half,all",
            help="comma list of min, half, all, shares like 25%% or sizes like 2GB "
            "(default min,half,all)",
        )
        _bench_device(bd)
        bd.add_argument(
            "--read-parts",
            type=int,
            default=None,
            help="parts each record is read in at once (default: one per 2 MB, at most 4)",
        )
        _bench_tokens(bd, prompt=prompt_default, reply=48)
        bd.add_argument("--workers", type=int, default=4, help="I/O threads (default 4)")
        _bench_seed(bd, "the random prompt")
        bd.add_argument(
            "--spec", type=int, default=0, help="gate-echo bets (decode only; default 0)"
        )
        bd.add_argument(
            "--no-lookahead",
            dest="lookahead",
            action="store_false",
            help="do not prefetch the next layer's predicted experts (decode only)",
        )
        if name == "decode":
            bd.add_argument(
                "--host-tiers",
                default=None,
                help="comma list of host tier sizes, each a row per budget: shares of every "
                "expert like 0,50%%,100%% or sizes like 64GB (a staged ring: a GPU's; "
                "default: none, and no host tier)",
            )
        if name == "prefill":
            bd.add_argument(
                "--lengths",
                default=None,
                help="comma list of prompt lengths, each a row per budget (default: "
                "--prompt-tokens)",
            )
            bd.add_argument(
                "--schedules",
                default="layer",
                help="comma list of layer (layer-major over the whole prompt, the engine's) "
                "and chunk (each chunk through every layer, as before) (default layer)",
            )
        bd.add_argument(
            "--plot",
            type=Path,
            default=None,
            help="decode: write a PNG of the per-token time breakdown here (needs "
            "smoe[plot]; default: none)",
        )
        bd.set_defaults(func=cmd_bench_limits)


def _add_bench_resident(bsub: Any) -> None:
    """`smoe bench`: every expert resident, against mlx-lm."""
    br = bsub.add_parser(
        "resident", help="every expert resident: the engine against mlx-lm in memory"
    )
    br.add_argument("vault", type=Path, help="the vault to run")
    _bench_tokens(br, prompt=256, reply=64)
    br.add_argument(
        "--prefill-chunk", type=int, default=64, help="prompt tokens per chunk (default 64)"
    )
    _bench_seed(br, "the random prompt")
    _bench_device(br)
    br.set_defaults(func=cmd_bench_resident)
