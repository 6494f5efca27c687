"""Generation straight from a download vs from its vault: same model, same budget, one run.

    python bench/source_vs_vault.py WORKDIR [--ring 1GB] [--tokens 24] [--rounds 3]
                                            [--layers 2] [--format hf|mlx4]

WORKDIR/src is a Qwen3-30B-A3B-geometry checkpoint (`smoe synth --preset qwen3-30b-a3b`:
128 experts of 9.4 MB in bf16, top-8, --layers layers), made if missing. --format hf (the
default) runs it as a Hugging Face download, against its `smoe convert --bits 16`
(WORKDIR/vault: the same bytes, one record per expert). --format mlx4 runs what
`mlx_lm.convert -q` makes of it (WORKDIR/mlx4, an mlx-community folder: 4-bit, group 64,
each expert a slice of stacked tensors), against its `smoe convert` (WORKDIR/vault4, the
same 4-bit bytes). All are made if missing. Each
round generates the same greedy tokens from both, alternating which goes first, each on a
fresh engine with the same ring (--ring: its size, a share of the experts or 'all'). Before that, the readers alone read every
expert once per round (GB/s, alternating). Prints one JSON object: per side the median
decode and prefill tok/s over the rounds, the reads per expert (extents of the source's
index; 1 for a vault record), bytes read per decoded token, the share of decode waiting
for reads; the readers' GB/s; and source / vault ratios.
Source statistics go to a cache under WORKDIR, not to the user's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import harness
import mlx.core as mx

from smoe.bench.generate import budget_slots
from smoe.engine import Engine
from smoe.synth import synthesize
from smoe.vault.convert import ConvertOptions, convert
from smoe.vault.format import Vault
from smoe.vault.source import Source


def prepare(work: Path, layers: int, fmt: str) -> tuple[Path, Path]:
    """(the download, its vault) for --format ``fmt``, made if missing."""
    hf = work / "src"
    if not (hf / "config.json").exists():
        print("synthesizing the checkpoint ...", file=sys.stderr)
        synthesize(hf, arch="qwen3_moe", preset="qwen3-30b-a3b", layers=layers, seed=0)
    src, vault = (hf, work / "vault") if fmt == "hf" else (work / "mlx4", work / "vault4")
    if fmt == "mlx4" and not (src / "config.json").exists():
        print("quantizing it as mlx_lm.convert -q does ...", file=sys.stderr)
        mlx_quantized(hf, src)
    if not (vault / "manifest.json").exists():
        print("converting it ...", file=sys.stderr)
        # hf: --bits 16 keeps the shards' bf16 bytes; mlx4: the source's 4-bit bytes
        convert(src, vault, ConvertOptions(bits=16 if fmt == "hf" else None))
    return src, vault


def mlx_quantized(hf: Path, out: Path) -> None:
    """What `mlx_lm.convert -q` writes (an mlx-community folder), by mlx-lm's own
    functions, built under a temporary name."""
    import shutil

    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    import json

    # transformers 5 writes rope_parameters and num_local_experts; mlx-lm reads these names
    config = json.loads((hf / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    fixes = {
        "rope_theta": config.get("rope_theta", rope.get("rope_theta")),
        "num_experts": config.get("num_experts", config.get("num_local_experts")),
    }
    model, config = load_model(hf, lazy=True, model_config=fixes)
    with contextlib.redirect_stdout(sys.stderr):  # mlx-lm prints its bits per weight
        model, config = quantize_model(model, config, group_size=64, bits=4)
    save_model(tmp, model)
    save_config(config, tmp / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (hf / name).exists():
            shutil.copy(hf / name, tmp / name)
    tmp.rename(out)


async def one_run(path: Path, prompt: list[int], tokens: int, slots: int) -> dict[str, Any]:
    async with Engine.open(path, slots=slots) as engine:
        out: list[int] = []
        stats = None
        async for ev in engine.generate(prompt, max_tokens=tokens, stop_at_eos=False):
            if ev.token is not None:
                out.append(ev.token)
            stats = ev.stats or stats
        assert stats is not None
        # A vault reads one record per read; a source as many extents as its index says.
        records = getattr(engine.debug.reader, "records", None)
        reads = getattr(engine.debug.reader, "reads", None)
        return {
            "tokens": out,
            "decode_tok_s": stats.decode_tok_s,
            "prefill_tok_s": stats.prefill_tok_s,
            "decode_bytes_per_token": stats.decode_bytes_per_token,
            "decode_hit_rate": stats.decode_hit_rate,
            "decode_io_wait_share": stats.decode_io_wait_share,
            "records_read": records,
            "reads": reads,
            "slots": engine.debug.ring.num_slots,
            "ring": engine.debug.ring.kind,
            "direct_io": engine.debug.reader.direct,
        }


class _HostRing:
    """Landings over host memory on huge pages: what a reader fills, with no compute."""

    kind = "unified"

    def __init__(self, stride: int, slots: int) -> None:
        import numpy as np

        from smoe.io.hugepages import HUGE_PAGE, advise_huge_pages

        self.stride, self.num_slots = stride, slots
        raw = np.empty(stride * slots + HUGE_PAGE, dtype=np.uint8)
        start = (-int(raw.ctypes.data)) % HUGE_PAGE
        self.memory = raw[start : start + stride * slots]
        advise_huge_pages(int(self.memory.ctypes.data), self.memory.nbytes)
        self.memory.fill(0)

    def land(self, slot: int) -> Any:
        view = memoryview(self.memory[slot * self.stride : (slot + 1) * self.stride])

        class Landing:
            memory = view

            def finish(self) -> memoryview:
                return view

            def hand_over(self) -> None:
                pass

            def discard(self) -> None:
                pass

        return Landing()


async def read_all(reader: Any, records: int, slots: int) -> float:
    """Seconds to read every record once, one read in flight per slot (a slot is read
    into again only once its last read is done)."""
    start = time.perf_counter()
    free = list(range(slots))
    pending: dict[asyncio.Future[int], int] = {}
    for r in range(records):
        if not free:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a failed read fails the benchmark
                free.append(pending.pop(task))
        slot = free.pop()
        pending[asyncio.ensure_future(reader.read(r, slot))] = slot
    await asyncio.gather(*pending)
    return time.perf_counter() - start


async def io_only(src: Path, vault_path: Path, rounds: int) -> dict[str, Any]:
    """GB/s reading every expert once, 8 reads in flight, 4 workers: the readers alone,
    alternating (the vault's reads verified against their checksums, as the engine's)."""
    from smoe.io.direct import DirectReader
    from smoe.io.shard_reader import ShardReader
    from smoe.vault.format import Vault

    source, vault = Source.open(src), Vault.open(vault_path)
    ring = _HostRing(vault.manifest.record.stride, 8)
    n, size = vault.manifest.num_records, vault.manifest.record.size
    rates: dict[str, list[float]] = {"source": [], "vault": []}
    for r in range(rounds):
        order = ["source", "vault"] if r % 2 == 0 else ["vault", "source"]
        for name in order:
            reader: Any = (
                ShardReader(source, ring, workers=4)
                if name == "source"
                else DirectReader(vault, ring, workers=4)
            )
            try:
                rates[name].append(n * size / await read_all(reader, n, 8) / 1e9)
            finally:
                reader.close()
    out: dict[str, Any] = {f"{k}_gb_s": statistics.median(v) for k, v in rates.items()}
    out.update({f"{k}_gb_s_runs": [round(x, 2) for x in v] for k, v in rates.items()})
    out["ratio_source_over_vault"] = out["source_gb_s"] / out["vault_gb_s"]
    return out


async def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("work", type=Path)
    p.add_argument("--ring", default="1GB", help="the ring's size, the same for both")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=16)
    harness.rounds(p, default=3)
    p.add_argument("--layers", type=int, default=2, help="the checkpoint's (when made)")
    p.add_argument("--format", choices=("hf", "mlx4"), default="hf")
    args = p.parse_args()
    os.environ.setdefault("SMOE_CACHE", str(args.work / "cache"))
    src, vault = prepare(args.work, args.layers, args.format)
    io = await io_only(src, vault, args.rounds)
    print(f"reads alone: {io}", file=sys.stderr)
    prompt = [(7 * i + 3) % 4000 + 2 for i in range(args.prompt_tokens)]
    slots = budget_slots(Vault.open(vault), args.ring)  # in the vault's records, for both
    runs: dict[str, list[dict[str, Any]]] = {"source": [], "vault": []}
    for r in range(args.rounds):
        order = [("source", src), ("vault", vault)]
        for name, path in order if r % 2 == 0 else order[::-1]:
            runs[name].append(await one_run(path, prompt, args.tokens, slots))
            last = runs[name][-1]
            print(
                f"round {r}: {name} {last['decode_tok_s']:.2f} tok/s, "
                f"io wait {last['decode_io_wait_share']:.0%}",
                file=sys.stderr,
            )
    same = all(
        a["tokens"] == b["tokens"] for a, b in zip(runs["source"], runs["vault"], strict=True)
    )

    def side(rs: list[dict[str, Any]]) -> dict[str, Any]:
        last = rs[-1]
        return {
            "decode_tok_s": statistics.median(x["decode_tok_s"] for x in rs),
            "decode_tok_s_runs": [round(x["decode_tok_s"], 3) for x in rs],
            "prefill_tok_s": statistics.median(x["prefill_tok_s"] for x in rs),
            "reads_per_expert": (last["reads"] / last["records_read"]) if last["reads"] else 1.0,
            "decode_mb_per_token": last["decode_bytes_per_token"] / 1e6,
            "decode_hit_rate": last["decode_hit_rate"],
            "decode_io_wait_share_runs": [round(x["decode_io_wait_share"], 3) for x in rs],
            "slots": last["slots"],
            "ring": last["ring"],
            "direct_io": last["direct_io"],
        }

    s, v = side(runs["source"]), side(runs["vault"])
    index = Source.open(src).index
    layers = Vault.open(vault).manifest.topology["num_layers"]
    harness.report(
        {
            "model": (
                f"qwen3_moe, Qwen3-30B-A3B expert geometry, {layers} layers, "
                + ("bf16 experts" if args.format == "hf" else "4-bit experts (mlx4)")
            ),
            "format": args.format,
            "device": str(mx.default_device()),
            "record_bytes": index.layout.size,
            "shards": len(index.files),
            "ring": args.ring,
            "tokens": args.tokens,
            "prompt_tokens": args.prompt_tokens,
            "rounds": args.rounds,
            "same_tokens": same,
            "source": s,
            "vault": v,
            "decode_ratio_source_over_vault": s["decode_tok_s"] / v["decode_tok_s"],
            "io_only": io,
            "prefill_ratio_source_over_vault": s["prefill_tok_s"] / v["prefill_tok_s"],
        },
        args,
    )


if __name__ == "__main__":
    asyncio.run(main())
