"""The `smoe` command line. Each subcommand is a thin shell over the Python API.

User mistakes (SmoeError) print one line and exit 2; Ctrl-C or SIGTERM exit 130 after
the running command has cleaned up after itself.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from smoe.errors import SmoeError


def _progress_bar(desc: str, quiet: bool) -> Callable[[str, int, int], None] | None:
    """A tqdm-backed progress callback (stage, done, total), or None when quiet."""
    if quiet:
        return None
    from tqdm import tqdm

    bars: dict[str, Any] = {}

    def update(stage: str, done: int, total: int) -> None:
        bar = bars.get(stage)
        if bar is None:
            bar = bars[stage] = tqdm(
                total=total,
                desc=f"{desc} {stage}",
                unit="layer" if stage == "experts" else "part",
                file=sys.stderr,
                leave=True,
                dynamic_ncols=True,
            )
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return update


def cmd_convert(args: argparse.Namespace) -> int:
    from smoe.util.sizes import format_bytes
    from smoe.vault.convert import ConvertOptions, convert

    opts = ConvertOptions(
        bits=args.bits,
        group_size=args.group_size,
        dtype=args.dtype,
        backbone_bits=args.backbone_bits,
        backbone_group_size=args.backbone_group_size,
        force=args.force,
    )
    start = time.perf_counter()
    vault = convert(args.src, args.vault, opts, _progress_bar("convert", args.quiet))
    seconds = time.perf_counter() - start
    m = vault.manifest
    src_bytes = m.source["bytes"]
    print(
        f"wrote {vault.path}: {m.num_records} expert records of {format_bytes(m.record.size)}, "
        f"backbone {format_bytes(m.backbone['bytes'])}, in {seconds:.1f} s "
        f"({src_bytes / 1e6 / max(seconds, 1e-9):.0f} MB/s of source)"
    )
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from smoe.vault.format import Vault
    from smoe.vault.inspect import render, summary, verify, verify_files

    vault = Vault.open(args.vault)
    info = summary(vault)
    bad = None
    files = []
    if args.verify:
        files = verify_files(vault)
        bar = None
        if not args.quiet and not args.json:
            from tqdm import tqdm

            bar = tqdm(
                total=vault.manifest.num_records,
                desc="verify",
                unit="record",
                file=sys.stderr,
                dynamic_ncols=True,
            )

        def tick(done: int, total: int) -> None:
            if bar is not None:
                bar.update(done - bar.n)

        bad = verify(vault, tick)
        if bar is not None:
            bar.close()
        bad_files = [f for f in files if f.status == "bad"]
        info["verify"] = {
            "records": vault.manifest.num_records,
            "bad": [
                {"layer": b.layer, "expert": b.expert, "index": b.index, "problems": b.problems}
                for b in bad
            ],
            "files": [{"file": f.file, "status": f.status, "message": f.message} for f in files],
            "ok": not bad and not bad_files,
        }
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print(render(info))
        for f in files:
            print(f"{'BAD file' if f.status == 'bad' else 'verify'}: {f.file} {f.message}")
        for b in bad or []:
            what = []
            if "checksum" in b.problems:
                what.append(f"checksum {b.actual:x}, expected {b.expected:x}")
            if b.padding_at is not None:
                what.append(f"nonzero padding at byte {b.padding_at} of the record")
            print(
                f"BAD record: layer {b.layer}, expert {b.expert} (record {b.index}): "
                + "; ".join(what)
            )
        if bad:
            print(
                f"verify: {len(bad)} of {vault.manifest.num_records} records are corrupt; "
                "convert the model again"
            )
        elif bad is not None:
            print(
                f"verify: all {vault.manifest.num_records} records match their checksums "
                "and their padding is zero"
            )
    return 1 if bad or any(f.status == "bad" for f in files) else 0


def cmd_synth(args: argparse.Namespace) -> int:
    from smoe.synth import synthesize

    bar = _progress_bar("synth", args.quiet)
    out = synthesize(
        Path(args.out),
        arch=args.arch,
        preset=args.preset,
        layers=args.layers,
        seed=args.seed,
        dtype=args.dtype,
        force=args.force,
        progress=bar,
    )
    print(f"wrote checkpoint {out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from smoe.vault.export import export_mlx
    from smoe.vault.format import Vault

    out = export_mlx(Vault.open(args.vault), args.out, force=args.force)
    print(f"wrote mlx-lm model {out}")
    return 0


def _id_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids like 1,2,3, got '{text}'") from None


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


def _parts_list(text: str) -> list[int | str]:
    """'auto,1,4' -> ['auto', 1, 4]; SmoeError for anything else."""
    out: list[int | str] = []
    for item in text.split(","):
        if item == "auto":
            out.append(item)
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
        parts=tuple(None if p == "auto" else p for p in _parts_list(args.parts)),
        verify=not args.no_verify,
        control=args.control,
    )
    print(json.dumps(report, indent=1))
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


def cmd_generate(args: argparse.Namespace) -> int:
    from smoe.util.loop import run

    return run(_generate(args))


async def _generate(args: argparse.Namespace) -> int:
    import anyio

    from smoe.engine import Engine
    from smoe.util.sizes import format_bytes

    if (args.prompt is None) == (args.prompt_ids is None):
        raise SmoeError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    prompt: Any = args.prompt if args.prompt is not None else args.prompt_ids
    tokens: list[int] = []
    text: list[str] = []
    stats: dict[str, Any] = {}
    finish = None
    async with Engine.open(args.vault, **_engine_options(args)) as engine:
        if args.routing_archive:
            engine.start_recording(args.archive_depth)
        async for event in engine.generate(
            prompt,
            max_tokens=args.max_tokens,
            temperature=args.temp,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
        ):
            if event.token is not None:
                tokens.append(event.token)
            if event.text:
                text.append(event.text)
                if not args.json:
                    print(event.text, end="", flush=True)
            if event.stats is not None:
                stats, finish = event.stats.to_json(), event.finish_reason
        stats["scheduler"] = engine.scheduler.stats.to_json()  # queue waits, read latencies
        stats["ring_slots"] = engine.ring.num_slots
        stats["compute_dtype_note"] = _dtype_note(engine)  # what "equal to mlx-lm" assumes
        stats["ring_bytes"] = engine.ring.nbytes
        if args.routing_archive:
            archive = engine.stop_recording()  # compressed and fsynced off the event loop
            saved = await anyio.to_thread.run_sync(archive.save, args.routing_archive)
            stats["routing_archive"] = str(saved)
    if args.json:
        print(
            json.dumps(
                {"tokens": tokens, "text": "".join(text), "finish_reason": finish, "stats": stats}
            )
        )
    else:
        print()
        print(
            f"[{len(tokens)} tokens, {finish}; first token {stats['ttft_s']:.2f} s, "
            f"prefill {stats['prefill_tok_s']:.1f} tok/s, decode {stats['decode_tok_s']:.2f} "
            f"tok/s, read {format_bytes(stats['bytes_read'])}, hit rate "
            f"{100 * stats['hit_rate']:.0f}%; computed in {stats['compute_dtype_note']}]",
            file=sys.stderr,
        )
    return 0


def _dtype_note(engine: Any) -> str:
    """The compute dtype and why (smoe.compute.model.compute_dtype_note)."""
    from smoe.compute.model import compute_dtype_note

    return compute_dtype_note(engine.vault, engine.dtype, engine.options.dtype is not None)


def cmd_chat(args: argparse.Namespace) -> int:
    from smoe.util.loop import run

    return run(_chat(args))


async def _chat(args: argparse.Namespace) -> int:
    import time

    from smoe.chat.demo import demo_vault
    from smoe.chat.repl import ChatApp, history_file
    from smoe.chat.sampling import suggested_sampling
    from smoe.engine import Engine

    start = time.perf_counter()
    vault = args.vault
    if vault is None:
        vault = demo_vault(progress=lambda msg: print(msg, file=sys.stderr))
    suggested = suggested_sampling(Path(vault))  # generation_config.json's, else greedy
    temperature = suggested["temperature"] if args.temp is None else args.temp
    top_p = suggested["top_p"] if args.top_p is None else args.top_p
    async with Engine.open(vault, **_engine_options(args)) as engine:
        print(
            f"loaded {vault} in {time.perf_counter() - start:.1f} s; computing in "
            f"{_dtype_note(engine)}; sampling at temperature {temperature:g}, top_p "
            f"{top_p:g}" + (" (the model's suggestion)" if args.temp is None else ""),
            file=sys.stderr,
        )
        app = ChatApp(
            engine,
            engine.conversation(system=args.system),
            history=history_file(),
            sampling={
                "max_tokens": args.max_tokens,
                "temperature": temperature,
                "top_p": top_p,
                "seed": args.seed,
            },
        )
        await app.run()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from smoe.util.loop import run

    return run(_serve(args))


async def _serve(args: argparse.Namespace) -> int:
    from smoe.engine import Engine
    from smoe.serve.app import ServerOptions, serve
    from smoe.util.sizes import parse_size

    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"warning: serving on {args.host} without --api-key", file=sys.stderr)
    if args.max_batch < 1 or args.max_queue < 0:
        raise SmoeError("--max-batch must be at least 1 and --max-queue at least 0")
    options = ServerOptions(
        api_key=args.api_key,
        max_queue=args.max_queue,
        model_name=args.vault.name,
        prewarm_when_idle=args.prewarm,
        cached_bytes=parse_size(args.prefix_cache),
    )
    async with Engine.open(args.vault, **_engine_options(args), max_batch=args.max_batch) as engine:

        def ready(port: int) -> None:
            print(
                f"serving {args.vault} on http://{args.host}:{port}/v1, computing in "
                f"{_dtype_note(engine)}",
                file=sys.stderr,
            )

        await serve(engine, args.host, args.port, options, ready=ready)
    return 0


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """Engine.open keyword arguments from the options _memory_option adds."""
    return {
        "memory": args.memory,
        "slots": args.slots,
        "workers": args.workers,
        "dtype": args.dtype,
        "prefill_chunk": args.prefill_chunk,
        "device": args.device,
        "ring": args.ring,
        "policy": args.policy,
        "hint_depth": args.hint_depth,
        "spec": args.spec,
        "lookahead": args.lookahead,
    }


def _memory_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--memory",
        default=None,
        help="expert ring budget, e.g. 6GB (default: every expert if they fit in half the "
        "available memory beside the backbone, else as many as fit)",
    )
    p.add_argument(
        "--slots", type=int, default=None, help="ring size in experts (wins over --memory)"
    )
    p.add_argument("--workers", type=int, default=4, help="I/O threads (default 4)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="compute dtype (default float32 on CPU, bfloat16 on GPU)",
    )
    p.add_argument("--prefill-chunk", type=int, default=64, help="prompt tokens per chunk")
    p.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        default=None,
        help="compute device (default: MLX's, the GPU where there is one)",
    )
    p.add_argument(
        "--ring",
        choices=("auto", "unified", "staged"),
        default="auto",
        help="where reads land: unified (in the slots: CPU, Apple) or staged (host landing "
        "buffers copied into device arrays in the compute dtype: CUDA GPUs, and vaults whose "
        "scales are not in the compute dtype); auto picks (docs/gpu.md)",
    )
    p.add_argument(
        "--policy",
        default="lfu",
        help="ring eviction policy: lfu (default), lru, slru, arc, lru-layer; lfu+hint, "
        "lru+hint and lru-layer+hint also feed it the router's near misses "
        "(docs/cache-policy.md)",
    )
    p.add_argument(
        "--hint-depth",
        type=int,
        default=None,
        help="with a +hint policy: hint gate ranks top_k..N-1 (default 4 x top_k)",
    )
    p.add_argument(
        "--no-lookahead",
        dest="lookahead",
        action="store_false",
        help="do not prefetch the next layer's experts predicted by its router on this "
        "layer's input (on by default: docs/speculation.md)",
    )
    p.add_argument(
        "--spec",
        type=int,
        default=0,
        help="gate-echo bets: prefetch gate ranks k..k+N-1 for the next token "
        "(default 0: measured net negative so far, docs/speculation.md)",
    )


def cmd_bench_generate(args: argparse.Namespace) -> int:
    from smoe.bench.generate import bench_generate
    from smoe.util.loop import run

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
    print(json.dumps(report, indent=1))
    for r in report["runs"]:
        print(
            f"{r['budget']:>6} ({r['ring_slots']} slots): first token {r['ttft_s']:.2f} s, "
            f"prefill {r['prefill_tok_s']:.1f} tok/s, decode {r['decode_tok_s']:.2f} tok/s, "
            f"decode hit {100 * r['decode_hit_rate']:.0f}%, "
            f"{r['decode_bytes_per_token'] / 1e6:.1f} MB/token, "
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
    print(json.dumps(report, indent=1))
    e, r = report["engine"], report["mlx_lm"]
    print(
        f"decode {e['decode_tok_s']:.1f} vs mlx-lm {r['decode_tok_s']:.1f} tok/s "
        f"({report['decode_ratio']:.2f}x); prefill {e['prefill_tok_s']:.1f} vs "
        f"{r['prefill_tok_s']:.1f} tok/s ({report['prefill_ratio']:.2f}x); "
        f"tokens equal: {report['tokens_equal']}",
        file=sys.stderr,
    )
    return 0


def cmd_bench_decode(args: argparse.Namespace) -> int:
    from smoe.bench.decode import bench_decode, bench_prefill
    from smoe.util.loop import run

    budgets = args.budgets.split(",")
    if args.bench == "decode":
        report = run(
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
            )
        )
    else:
        report = run(
            bench_prefill(
                str(args.vault),
                budgets,
                prompt_tokens=args.prompt_tokens,
                workers=args.workers,
                seed=args.seed,
                device=args.device,
                ring=args.ring,
            )
        )
    if args.plot and args.bench == "decode":
        from smoe.bench.plots import plot_time_breakdown

        plot_time_breakdown(report["runs"], args.plot)
        report["plot"] = str(args.plot)
    print(json.dumps(report, indent=1))
    for r in report["runs"]:
        if args.bench == "decode":
            print(
                f"{r['budget']:>6} ({r['ring_slots']} slots): {r['decode_tok_s']:.2f} tok/s, "
                f"{1e3 * r['time_per_token_s']:.1f} ms/token vs limit "
                f"{1e3 * r['physical_limit_s']:.1f} ms ({r['ratio_to_limit']:.2f}x); "
                f"hit {100 * r['decode_hit_rate']:.0f}%, {r['bytes_per_token'] / 1e6:.1f} MB/token",
                file=sys.stderr,
            )
        else:
            print(
                f"{r['budget']:>6} ({r['ring_slots']} slots): first token {r['ttft_s']:.2f} s, "
                f"{r['prefill_tok_s']:.1f} tok/s, read {r['prefill_bytes'] / 1e6:.0f} MB",
                file=sys.stderr,
            )
    return 0


def cmd_bench_policy(args: argparse.Namespace) -> int:
    from smoe.bench.policy import main as policy_main

    return policy_main(args.rest, prog="smoe bench policy")


def cmd_bench_locality(args: argparse.Namespace) -> int:
    from smoe.bench.policy import bench_locality
    from smoe.telemetry.archive import RoutingArchive

    report = bench_locality(RoutingArchive.load(args.archive))
    print(json.dumps(report, indent=1))
    print(json.dumps(report.get("headline", {})), file=sys.stderr)
    return 0


def cmd_bench_trace(args: argparse.Namespace) -> int:
    from smoe.telemetry.traces import preset_trace

    archive = preset_trace(args.preset, args.tokens, seed=args.seed, layers=args.layers)
    print(f"wrote {archive.save(args.out)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smoe",
        description="Run Mixture-of-Experts models larger than memory, streaming experts "
        "from an SSD vault, with output identical to running them in memory.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_convert(sub)
    _add_inspect(sub)
    _add_synth(sub)
    _add_generate(sub)
    _add_chat(sub)
    _add_serve(sub)
    _add_bench(sub)
    _add_export(sub)
    return p


def _add_convert(sub: Any) -> None:
    """`smoe convert` and its options."""
    from smoe.vault.convert import BITS_CHOICES, DTYPE_CHOICES, GROUP_CHOICES

    c = sub.add_parser("convert", help="convert a Hugging Face or MLX checkpoint into a vault")
    c.add_argument("src", type=Path, help="checkpoint folder (config.json + *.safetensors)")
    c.add_argument("vault", type=Path, help="vault folder to create")
    c.add_argument(
        "--bits",
        type=int,
        choices=BITS_CHOICES,
        default=None,
        help="expert quantization (default 4; 16 keeps float weights; "
        "MLX-quantized sources are copied as they are)",
    )
    c.add_argument(
        "--group-size",
        type=int,
        choices=GROUP_CHOICES,
        default=None,
        help="quantization group size (default 64)",
    )
    c.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default=None,
        help="dtype of float tensors (default: the source's; float32 suits the CPU)",
    )
    c.add_argument(
        "--backbone-bits",
        type=int,
        choices=BITS_CHOICES[:-1],
        default=None,
        help="also quantize the backbone's linear layers (routers stay float)",
    )
    c.add_argument("--backbone-group-size", type=int, choices=GROUP_CHOICES, default=64)
    c.add_argument("--force", action="store_true", help="replace an existing vault")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.set_defaults(func=cmd_convert)


def _add_inspect(sub: Any) -> None:
    """`smoe inspect` and its options."""
    i = sub.add_parser("inspect", help="describe a vault; --verify re-checks every record")
    i.add_argument("vault", type=Path)
    i.add_argument("--json", action="store_true", help="print JSON")
    i.add_argument(
        "--verify",
        action="store_true",
        help="re-read every record (checksum, zero padding) and check the backbone's and "
        "config's checksums (exit 1 if any is bad)",
    )
    i.add_argument("--quiet", action="store_true")
    i.set_defaults(func=cmd_inspect)

    # synth's choices are checked by synthesize(): importing it here would load torch.


def _add_synth(sub: Any) -> None:
    """`smoe synth` and its options."""
    from smoe.models.registry import ARCHITECTURES
    from smoe.vault.convert import DTYPE_CHOICES

    s = sub.add_parser("synth", help="write a random, decisive MoE checkpoint (HF format)")
    s.add_argument("out", type=Path)
    s.add_argument(
        "--arch",
        default="qwen3_moe",
        help=f"one of {', '.join(ARCHITECTURES)} (default qwen3_moe)",
    )
    s.add_argument(
        "--preset",
        default="tiny",
        help="tiny (default), demo, qwen3-30b-a3b, qwen3-235b-a22b (real expert "
        "geometry, few layers)",
    )
    s.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--dtype", choices=DTYPE_CHOICES, default="bfloat16")
    s.add_argument("--force", action="store_true")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(func=cmd_synth)


def _add_generate(sub: Any) -> None:
    """`smoe generate` and its options."""
    g = sub.add_parser("generate", help="generate text from a prompt, streaming experts")
    g.add_argument("vault", type=Path)
    g.add_argument("--prompt", default=None, help="prompt text (tokenized without a chat template)")
    g.add_argument("--prompt-ids", type=_id_list, default=None, help="prompt token ids: 1,2,3")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument(
        "--json",
        action="store_true",
        help='print one JSON object with "tokens", "text" and "stats"',
    )
    g.add_argument(
        "--routing-archive",
        type=Path,
        default=None,
        help="record every routing decision (with deeper gate ranks) to this .npz",
    )
    g.add_argument("--archive-depth", type=int, default=16, help="gate ranks kept per decision")
    _memory_option(g)
    g.set_defaults(func=cmd_generate)


def _add_chat(sub: Any) -> None:
    """`smoe chat` and its options."""
    ch = sub.add_parser("chat", help="chat with a model (the built-in demo without VAULT)")
    ch.add_argument(
        "vault",
        type=Path,
        nargs="?",
        default=None,
        help="vault folder (default: the built-in demo, made on first use)",
    )
    ch.add_argument("--system", default=None, help="system prompt")
    ch.add_argument("--max-tokens", type=int, default=256)
    ch.add_argument(
        "--temp", type=float, default=None, help="temperature (default: the model's suggestion)"
    )
    ch.add_argument("--top-p", type=float, default=None, help="(default: the model's suggestion)")
    ch.add_argument("--seed", type=int, default=None)
    _memory_option(ch)
    ch.set_defaults(func=cmd_chat)


def _add_serve(sub: Any) -> None:
    """`smoe serve` and its options."""
    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    sv.add_argument("vault", type=Path)
    sv.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    sv.add_argument(
        "--max-queue",
        type=int,
        default=16,
        help="requests that may wait for a place in the batch; more get 429",
    )
    sv.add_argument(
        "--max-batch",
        type=int,
        default=8,
        help="requests decoded together, one token each per step (1: one at a time)",
    )
    sv.add_argument(
        "--prefix-cache",
        default="2GB",
        help="memory for the KV caches kept for prefix reuse (last 8 requests; 0: off)",
    )
    sv.add_argument(
        "--no-prewarm",
        dest="prewarm",
        action="store_false",
        help="do not read the historically hottest experts into empty slots when idle",
    )
    _memory_option(sv)
    sv.set_defaults(func=cmd_serve)


def _add_bench(sub: Any) -> None:
    """`smoe bench ...`: every benchmark and its options."""
    b = sub.add_parser("bench", help="benchmarks (JSON on stdout, a summary on stderr)")
    bsub = b.add_subparsers(dest="bench", required=True, metavar="BENCH")
    _add_bench_io(bsub)
    _add_bench_generate(bsub)
    _add_bench_limits(bsub)
    _add_bench_resident(bsub)
    _add_bench_routing(bsub)


def _add_bench_io(bsub: Any) -> None:
    """`smoe bench`: reads: the streamer against raw O_DIRECT."""
    bio = bsub.add_parser("io", help="streamer read throughput vs a raw O_DIRECT baseline")
    bio.add_argument("vault", type=Path)
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
        "--repeats", type=int, default=4, help="runs of each kind per worker count, in ABBA order"
    )
    bio.add_argument("--batch", type=int, default=8, help="experts per acquire (top-k)")
    bio.add_argument("--slots", type=int, default=64, help="ring slots for the streamer")
    bio.add_argument(
        "--path",
        default="unified",
        help="rings to measure: unified (reads land in the slots), staged (disk -> host "
        "landing -> device arrays), or both: unified,staged",
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
        help="parts the streamer reads each record in, e.g. auto,1 (auto: one per 2 MB, at most 4)",
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
    bio.add_argument("--seed", type=int, default=0)
    bio.set_defaults(func=cmd_bench_io)


def _add_bench_generate(bsub: Any) -> None:
    """`smoe bench`: prefill and decode at several budgets."""
    bg = bsub.add_parser("generate", help="prefill and decode at several memory budgets")
    bg.add_argument("vault", type=Path)
    bg.add_argument(
        "--budgets",
        default="min,half,all",
        help="comma list of min, half, all or sizes like 2GB (default min,half,all)",
    )
    bg.add_argument("--prompt-tokens", type=int, default=128)
    bg.add_argument("--max-tokens", type=int, default=32)
    bg.add_argument("--workers", type=int, default=4)
    bg.add_argument("--seed", type=int, default=0)
    bg.set_defaults(func=cmd_bench_generate)


def _add_bench_limits(bsub: Any) -> None:
    """`smoe bench`: decode and prefill against their physical limits."""
    for name, prompt_default, doc in (
        ("decode", 16, "decode tok/s, bytes/token, I/O wait, vs the physical limit"),
        ("prefill", 256, "time to first token and prefill tok/s of a long prompt"),
    ):
        bd = bsub.add_parser(name, help=doc)
        bd.add_argument("vault", type=Path)
        bd.add_argument(
            "--budgets",
            default="min,half,all",
            help="comma list of min, half, all, shares like 25%% or sizes like 2GB",
        )
        bd.add_argument("--device", choices=("cpu", "gpu"), default=None)
        bd.add_argument("--ring", choices=("auto", "unified", "staged"), default="auto")
        bd.add_argument(
            "--read-parts",
            type=int,
            default=None,
            help="parts each record is read in at once (default: one per 2 MB, at most 4)",
        )
        bd.add_argument("--prompt-tokens", type=int, default=prompt_default)
        bd.add_argument("--max-tokens", type=int, default=48)
        bd.add_argument("--workers", type=int, default=4)
        bd.add_argument("--seed", type=int, default=0)
        bd.add_argument("--spec", type=int, default=0, help="gate-echo bets (decode only)")
        bd.add_argument("--no-lookahead", dest="lookahead", action="store_false")
        bd.add_argument(
            "--plot",
            type=Path,
            default=None,
            help="write a PNG of the per-token time breakdown (needs smoe[plot])",
        )
        bd.set_defaults(func=cmd_bench_decode)


def _add_bench_resident(bsub: Any) -> None:
    """`smoe bench`: every expert resident, against mlx-lm."""
    br = bsub.add_parser(
        "resident", help="every expert resident: the engine against mlx-lm in memory"
    )
    br.add_argument("vault", type=Path)
    br.add_argument("--prompt-tokens", type=int, default=256)
    br.add_argument("--max-tokens", type=int, default=64)
    br.add_argument("--prefill-chunk", type=int, default=64)
    br.add_argument("--seed", type=int, default=0)
    br.add_argument("--device", choices=("cpu", "gpu"), default=None)
    br.add_argument("--ring", choices=("auto", "unified", "staged"), default="auto")
    br.set_defaults(func=cmd_bench_resident)


def _add_bench_routing(bsub: Any) -> None:
    """`smoe bench`: policy, locality and trace: routing research."""
    bp = bsub.add_parser(
        "policy",
        add_help=False,
        help="replay a routing archive or a synthetic trace against eviction "
        "policies and Belady's optimum (--help for options)",
    )
    # Its options are smoe.bench.policy's own: main() hands it what this parser does not know.
    bp.set_defaults(func=cmd_bench_policy, passthrough=True)
    bl = bsub.add_parser("locality", help="expert reuse between tokens, from a routing archive")
    bl.add_argument("archive", type=Path)
    bl.set_defaults(func=cmd_bench_locality)
    bt = bsub.add_parser("trace", help="write a synthetic routing trace with published locality")
    bt.add_argument("out", type=Path)
    bt.add_argument("--preset", default="qwen3-235b-like")
    bt.add_argument("--tokens", type=int, default=2000)
    bt.add_argument("--layers", type=int, default=None)
    bt.add_argument("--seed", type=int, default=0)
    bt.set_defaults(func=cmd_bench_trace)


def _add_export(sub: Any) -> None:
    """`smoe export` and its options."""
    e = sub.add_parser("export", help="write a vault back out as an mlx-lm model folder")
    e.add_argument("vault", type=Path)
    e.add_argument("out", type=Path)
    e.add_argument("--force", action="store_true")
    e.set_defaults(func=cmd_export)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _raise_interrupt)  # clean up temp output on kill too
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "passthrough", False):
        args.rest = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return int(args.func(args))
    except SmoeError as e:
        print(f"smoe {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"smoe {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 1


if __name__ == "__main__":
    sys.exit(main())
