"""`smoe convert`, `smoe inspect`, `smoe synth` and `smoe export`: the commands that
make, check and write out checkpoints and vaults."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from smoe.errors import SmoeError

if TYPE_CHECKING:
    from smoe.vault.format import Vault
    from smoe.vault.inspect import BadRecord, FileCheck


# What each stage of a progress callback counts (synthesize, convert, cut_shard).
_STAGE_UNITS = {"weights": "B", "experts": "layer", "records": "record"}


def bar_units(stage: str) -> dict[str, Any]:
    """tqdm's unit options for ``stage``: a stage that counts bytes shows them scaled in
    decimal units (kB, MB, GB), as format_bytes prints every other size; the tokenizer and
    backbone stages count their one file."""
    unit = _STAGE_UNITS.get(stage, "file")
    if unit == "B":
        return {"unit": "B", "unit_scale": True, "unit_divisor": 1000}
    return {"unit": unit}


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
                file=sys.stderr,
                leave=True,
                dynamic_ncols=True,
                **bar_units(stage),
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
        f"wrote {vault.path}: {m.num_records} expert records of "
        f"{format_bytes(m.record.stride)} on disk, backbone {format_bytes(m.backbone['bytes'])}, in "
        f"{seconds:.1f} s ({src_bytes / 1e6 / max(seconds, 1e-9):.0f} MB/s of source)"
    )
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from smoe.vault.hub import resolve_model
    from smoe.vault.inspect import render, summary, verify_files
    from smoe.vault.source import open_model

    # A vault, or a download streamed from its shards; a Hub name is its cached snapshot.
    vault = open_model(resolve_model(args.vault, offers_download=False))
    if not vault.has_checksums and args.verify:
        raise SmoeError(
            f"{vault.path} is a download: it has no checksums to verify; 'smoe convert' "
            "makes a vault whose every record is checked"
        )
    info = summary(vault)
    bad: list[BadRecord] | None = None
    files: list[FileCheck] = []
    if args.verify:
        files = verify_files(vault)
        bad = _verify_records(vault, show_bar=not args.quiet and not args.json)
        info["verify"] = _verify_report(vault, bad, files)
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print(render(info))
        _print_verify(vault, bad, files)
    return 1 if bad or any(f.status == "bad" for f in files) else 0


def _verify_records(vault: Vault, show_bar: bool) -> list[BadRecord]:
    """Every record re-read (smoe.vault.inspect.verify), with a progress bar on stderr."""
    from smoe.vault.inspect import verify

    bar = None
    if show_bar:
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
    return bad


def _verify_report(vault: Vault, bad: list[BadRecord], files: list[FileCheck]) -> dict[str, Any]:
    """The "verify" entry of `smoe inspect --verify --json`."""
    bad_files = [f for f in files if f.status == "bad"]
    return {
        "records": vault.manifest.num_records,
        "bad": [
            {"layer": b.layer, "expert": b.expert, "index": b.index, "problems": b.problems}
            for b in bad
        ],
        "files": [{"file": f.file, "status": f.status, "message": f.message} for f in files],
        "ok": not bad and not bad_files,
    }


def _print_verify(vault: Vault, bad: list[BadRecord] | None, files: list[FileCheck]) -> None:
    """The verify lines of `smoe inspect --verify`: bad files and records, then a verdict
    (nothing when bad is None: --verify was not given)."""
    for f in files:
        print(f"{'BAD file' if f.status == 'bad' else 'verify'}: {f.file} {f.message}")
    for b in bad or []:
        what = []
        if "checksum" in b.problems:
            what.append(f"checksum {b.actual:x}, expected {b.expected:x}")
        if b.padding_at is not None:
            what.append(f"nonzero padding at byte {b.padding_at} of the record")
        print(
            f"BAD record: layer {b.layer}, expert {b.expert} (record {b.index}): " + "; ".join(what)
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

    vault = Vault.open(args.vault)
    if vault.manifest.shard is not None:
        raise SmoeError(f"{vault.path} is a shard (some experts only); export the full vault")
    out = export_mlx(vault, args.out, force=args.force)
    print(f"wrote mlx-lm model {out}")
    return 0


def cmd_shard(args: argparse.Namespace) -> int:
    from smoe.parallel.cut import cut_shard
    from smoe.util.sizes import format_bytes

    bar = _progress_bar(f"shard {args.rank} of {args.ranks}", args.quiet)
    shard = cut_shard(
        args.vault,
        args.out,
        args.ranks,
        args.rank,
        force=args.force,
        progress=None if bar is None else lambda done, total: bar("records", done, total),
    )
    m = shard.manifest
    print(
        f"wrote {shard.path}: rank {args.rank} of {args.ranks}, {m.num_records} expert records "
        f"({format_bytes(m.experts_bytes)}) and the backbone"
    )
    return 0


def add_shard(sub: Any) -> None:
    """`smoe shard` and its options."""
    s = sub.add_parser(
        "shard",
        help="cut the vault of one expert-parallel rank: its experts and the backbone",
    )
    s.add_argument("vault", type=Path, help="the full vault")
    s.add_argument("out", type=Path, help="where the shard goes")
    s.add_argument("--ranks", type=int, required=True, help="ranks in the group")
    s.add_argument("--rank", type=int, required=True, help="the rank this shard is for")
    s.add_argument("--force", action="store_true", help="replace OUT if it exists")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_shard)


def add_convert(sub: Any) -> None:
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
        help="also quantize the backbone's linear layers (routers stay float; default: "
        "the backbone stays float, an MLX-quantized source's as it is)",
    )
    c.add_argument(
        "--backbone-group-size",
        type=int,
        choices=GROUP_CHOICES,
        default=64,
        help="with --backbone-bits: its quantization group size (default 64)",
    )
    c.add_argument("--force", action="store_true", help="replace an existing vault")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.set_defaults(func=cmd_convert)


def add_inspect(sub: Any) -> None:
    """`smoe inspect` and its options."""
    i = sub.add_parser(
        "inspect",
        help="describe a vault (or what a checkpoint folder would stream); --verify "
        "re-checks every record",
    )
    i.add_argument("vault", type=Path, help="a vault, or a checkpoint folder")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.add_argument(
        "--verify",
        action="store_true",
        help="re-read every record (checksum, zero padding) and check the backbone's and "
        "config's checksums (exit 1 if any is bad)",
    )
    i.add_argument("--quiet", action="store_true", help="no progress bar for --verify")
    i.set_defaults(func=cmd_inspect)


def add_synth(sub: Any) -> None:
    """`smoe synth` and its options."""
    from smoe.models.registry import ARCHITECTURES
    from smoe.vault.convert import DTYPE_CHOICES

    # synth's choices are checked by synthesize(): importing it here would load torch.
    s = sub.add_parser("synth", help="write a random, decisive MoE checkpoint (HF format)")
    s.add_argument("out", type=Path, help="checkpoint folder to create")
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
    s.add_argument(
        "--layers",
        type=int,
        default=None,
        help="override the preset's layer count (default: the preset's)",
    )
    s.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the same seed (and options) always writes the same files (default 0)",
    )
    s.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="bfloat16",
        help="dtype of the weights (default bfloat16)",
    )
    s.add_argument("--force", action="store_true", help="replace OUT if it exists")
    s.add_argument("--quiet", action="store_true", help="no progress bars")
    s.set_defaults(func=cmd_synth)


def add_export(sub: Any) -> None:
    """`smoe export` and its options."""
    e = sub.add_parser("export", help="write a vault back out as an mlx-lm model folder")
    e.add_argument("vault", type=Path, help="the (full) vault to export")
    e.add_argument("out", type=Path, help="mlx-lm model folder to create")
    e.add_argument("--force", action="store_true", help="replace OUT if it exists")
    e.set_defaults(func=cmd_export)
