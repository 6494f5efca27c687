"""Does the staged ring hold what the vault holds? On a GPU, after a request on a cold
ring, every slot's arrays are compared with its record read back from experts.bin, and
the request's tokens with mlx-lm's in memory; under each staging (direct landings, bounce
buffers) and I/O worker count, on fresh engines. Prints one JSON report.

    python bench/gpu/ring_check.py [--arch gpt_oss] [--bits 16] [--request 4] [--trials 2]
                                   [--no-compile] [--configs N]

mlx-lm's tokens are computed again after each engine (``mlx_lm_again``): is the in-memory
answer itself history-dependent? ``--no-compile`` runs with ``mx.disable_compile()`` (mlx-lm's
gpt_oss activation is ``mx.compile``-d); MLX's CUDA graphs are switched off from outside
(``MLX_USE_CUDA_GRAPHS=0``, read once per process); bench/gpu/history.sh runs each.

The case it was written for: tests/gpu/test_paths.py found gpt_oss at 16 bits giving other
tokens than mlx-lm on a cold ring and mlx-lm's on a warm one (docs/gpu.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402  (puts the checkout first on sys.path)
import mlx.core as mx  # noqa: E402

from smoe.engine import Engine  # noqa: E402
from smoe.vault.export import read_layer  # noqa: E402
from tests.gpu.gpu_common import ENGINE, first_difference, generate, load_models  # noqa: E402
from tests.gpu.test_paths import the_prompts  # noqa: E402


def ring_mismatches(engine: Engine) -> list[dict]:
    """Each (layer, expert) READY in the ring whose slot arrays differ from its record."""
    vault, sched, ring = engine.vault, engine.debug.scheduler, engine.debug.ring
    banks = ring.banks()
    bad = []
    for spec in vault.manifest.layers:
        want = read_layer(vault, spec.layer)
        for expert in sorted(sched.resident(spec.layer)):
            slot = sched.slot_of((spec.layer, expert))
            bank, local = ring.locate(slot)
            for name, stacked in want.items():
                have = banks[bank][name][local]
                ref = stacked[expert].astype(have.dtype)
                if not mx.array_equal(have, ref).item():
                    diff = mx.abs(have.astype(mx.float32) - ref.astype(mx.float32))
                    bad.append(
                        {
                            "layer": spec.layer,
                            "expert": expert,
                            "slot": slot,
                            "component": name,
                            "elements_differing": int((diff > 0).sum().item()),
                            "max_difference": float(diff.max().item()),
                        }
                    )
    return bad


def out_of_order_layers(engine: Engine) -> int:
    """MoE layers whose experts' slots do not ascend with the expert ids."""
    sched, count = engine.debug.scheduler, 0
    for spec in engine.vault.manifest.layers:
        slots = [sched.slot_of((spec.layer, e)) for e in sorted(sched.resident(spec.layer))]
        count += slots != sorted(slots)
    return count


async def one(vault, want, prompt, tokens, forget: bool, model=None, **options) -> dict:
    if forget:  # the popularity counts an earlier engine left: gone
        shutil.rmtree(vault.stats_dir, ignore_errors=True)
        vault.stats_dir.mkdir()
    async with Engine.open(vault.path, **{**ENGINE, **options}) as engine:
        got = await generate(engine, prompt, tokens)
        bad = ring_mismatches(engine)
        facts = {
            "out_of_order_layers": out_of_order_layers(engine),
            "slots_filled": engine.debug.scheduler.fill(),
            "staging_bounce": engine.debug.ring.bounce,
            "commits": engine.debug.ring.commits,
        }
    again = None
    if model is not None:  # mlx-lm in memory again, after this engine: does it still agree?
        from tests.gpu.gpu_common import reference

        now, _ = reference(model, prompt, tokens)
        again = {
            "mlx_lm_same_as_first": now == want,
            "engine_vs_mlx_lm_now": first_difference(got, now),
        }
    return {
        "mlx_lm_again": again,
        "forget": forget,
        "first_difference": first_difference(got, want),
        "mismatching_components": len(bad),
        "mismatches": bad[:6],
        **facts,
    }


async def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--arch", default="gpt_oss")
    p.add_argument("--bits", type=int, default=16)
    p.add_argument("--request", type=int, default=4)
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--no-compile", action="store_true", help="mx.disable_compile() first")
    p.add_argument("--configs", type=int, default=4, help="the first N staging configs")
    args = p.parse_args()
    if args.no_compile:
        mx.disable_compile()
    from tests.gpu.gpu_common import reference

    root = Path(tempfile.mkdtemp())

    def folder(name: str) -> Path:
        (root / name).mkdir()
        return root / name

    models = load_models(folder)
    vault, model = models(args.arch, args.bits)
    prompt = the_prompts(int(vault.config()["vocab_size"]))[args.request]
    want, _ = reference(model, prompt, args.tokens)
    runs = []
    for staging, workers, forget in (
        ("direct", 4, False),
        ("direct", 4, True),
        ("bounce", 1, True),
        ("direct", 4, False),
    )[: args.configs]:
        os.environ["SMOE_STAGING"] = staging
        for trial in range(args.trials):
            r = await one(vault, want, prompt, args.tokens, forget, model, workers=workers)
            runs.append({"staging": staging, "workers": workers, "trial": trial, **r})
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    os.environ.pop("SMOE_STAGING")
    settings = {
        "compile": not args.no_compile,
        "MLX_USE_CUDA_GRAPHS": os.environ.get("MLX_USE_CUDA_GRAPHS", "(default)"),
    }
    harness.report({"arch": args.arch, "bits": args.bits, **settings, "runs": runs}, args)


if __name__ == "__main__":
    asyncio.run(main())
