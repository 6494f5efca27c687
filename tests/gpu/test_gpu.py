"""On a CUDA GPU: streaming through the staged ring gives mlx-lm's tokens, at every ring
size, and batched decode and drafts give each request its solo bits.

Run on the device machine (skipped elsewhere): ``python -m pytest -m gpu tests/test_gpu.py``.
With SMOE_GPU_REPORT=FILE each comparison appends a JSON line there: greedy tokens equal or
not, and how the logits differ (steps bit-identical, largest difference), the figures in
docs/gpu.md. CUDA's kernels choose their algorithm by the call's shape (gather_qmm: a
matrix-vector kernel below 8 rows, a tiled one above); the engine shapes every call, part
of a call and batched row to get the kernel its reference call gets
(smoe.compute.solo_rows), so the bits must be equal, not only the tokens.
SMOE_GPU_ARCHS and SMOE_GPU_BITS (comma lists) pick a subset.
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from smoe.bench.resident import fill_ring
from smoe.engine import Engine
from smoe.synth import synthesize
from smoe.vault.convert import ConvertOptions, convert
from tests.exact.test_engine_exact import ShuffledReads, engine_decode
from tests.gpu.gpu_common import (
    CHUNK,
    CUDA,
    ENGINE,
    GPU_MARKS,
    STEPS,
    first_difference,
    generate,
    reference,
    report,
)

pytestmark = GPU_MARKS

# qwen2_moe: a shared expert beside the routed ones; kjv_demo: the trained built-in demo,
# whose routing was learned (smoe/chat/demo_model); qwen3_30b: Qwen3-30B-A3B's geometry
# (128 experts top-8: a solo step's gathers already run the tiled kernel), 4 layers.
ARCHS = os.environ.get("SMOE_GPU_ARCHS", "qwen3_moe,qwen2_moe,kjv_demo,qwen3_30b").split(",")
BITS = [int(b) for b in os.environ.get("SMOE_GPU_BITS", "4,8,16").split(",")]


@pytest.mark.asyncio(loop_factories=["uvloop"])  # the loop smoe runs on; GPU time is scarce
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("arch", ARCHS)
async def test_greedy_tokens_equal_mlx_lm_at_every_ring(arch, bits, models):
    if bits == 16 and not CUDA:
        pytest.skip("MLX's CPU gather_mm computes float32 only")
    vault, model = models(arch, bits)
    m = vault.manifest
    top_k = m.shape.experts_per_token
    prompt = np.random.default_rng(7).integers(10, 4000, 100).tolist()
    want_tokens, want_logits = reference(model, prompt, STEPS)
    rings = {
        "min": top_k,
        "25%": max(top_k, m.num_records // 4),
        "50%": m.num_records // 2,
        "all": m.num_records,
    }
    wrong = {}
    for name, slots in rings.items():
        async with Engine.open(vault.path, slots=slots, **ENGINE) as engine:
            assert engine.debug.ring.kind == "staged" and engine.dtype == mx.bfloat16
            tokens = await generate(engine, prompt, STEPS)
            got, picks = await engine_decode(engine, prompt, want_tokens)
            diffs = [float(np.abs(a - b).max()) for a, b in zip(got, want_logits, strict=True)]
            same_bits = sum(np.array_equal(a, b) for a, b in zip(got, want_logits, strict=True))
            report(
                {
                    "test": "tokens_vs_mlx_lm",
                    "arch": arch,
                    "bits": bits,
                    "ring": name,
                    "slots": slots,
                    "tokens_equal": tokens == want_tokens,
                    "first_token_difference": next(
                        (
                            i
                            for i, (a, b) in enumerate(zip(tokens, want_tokens, strict=True))
                            if a != b
                        ),
                        None,
                    ),
                    "forced_picks_equal": picks == want_tokens,
                    "steps_bit_identical": f"{same_bits}/{STEPS}",
                    "max_logit_difference": max(diffs),
                    "logit_scale": float(np.abs(np.stack(want_logits)).max()),
                    "commits": engine.debug.ring.commits,
                }
            )
            if tokens != want_tokens:
                wrong[name] = tokens
            if name == "all":  # every expert pinned: device tables, decode built ahead
                await fill_ring(engine)
                resident = await generate(engine, prompt, STEPS)
                report(
                    {
                        "test": "resident_tokens_vs_mlx_lm",
                        "arch": arch,
                        "bits": bits,
                        "tokens_equal": resident == want_tokens,
                        "built_ahead": engine.debug.runner.built_ahead,
                    }
                )
                if resident != want_tokens or not engine.debug.runner.built_ahead:
                    wrong["resident"] = resident
    assert not wrong, (wrong, want_tokens)  # every ring is measured and reported first


@pytest.mark.asyncio(loop_factories=["uvloop"])  # the loop smoe runs on; GPU time is scarce
async def test_a_thousand_tokens_at_the_minimum_ring_under_shuffled_reads(models):
    """1,000 greedy tokens at the minimum ring (every layer's experts rewritten into the
    same few device slots, reads completing in shuffled order) against every expert
    resident: not one token differs."""
    vault, _ = models("qwen3_moe", 4)
    m = vault.manifest
    prompt = np.random.default_rng(11).integers(10, 4000, 24).tolist()
    n = 1000
    async with Engine.open(vault.path, slots=m.num_records, **ENGINE) as engine:
        want = await generate(engine, prompt, n)
    top_k = m.shape.experts_per_token
    async with Engine.open(vault.path, slots=top_k, workers=4, **ENGINE) as engine:
        shuffled = engine.debug.scheduler.wrap_backend(
            lambda inner: ShuffledReads(inner, 0, [], slow=0.0)
        )
        got = await generate(engine, prompt, n)
        commits = engine.debug.ring.commits
    wrong = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
    report(
        {
            "test": "stress_min_ring",
            "tokens": n,
            "wrong_tokens": len(wrong),
            "first_wrong": wrong[:5],
            "commits": commits,
            "reordered": shuffled.finished != shuffled.started,
        }
    )
    assert not wrong and shuffled.finished != shuffled.started


@pytest.mark.skipif(not CUDA, reason="a CUDA GPU's refusal")
@pytest.mark.parametrize("kv_bits", [8, 4])
def test_kv_bits_is_refused_on_cuda_where_mlx_lm_cannot_run_it(kv_bits, models, run_cli):
    """MLX's CUDA backend has no quantized matmul for attention over a quantized cache:
    mlx-lm's own generate_step fails on a prompt chunk (when this starts to pass, MLX has
    the kernel: lift smoe.plan.ring.check_kv_bits); the engine and `smoe plan`
    refuse --kv-bits there in one line, before loading anything."""
    from mlx_lm.generate import generate_step

    from smoe.plan.budget import kv_group_size

    vault, model = models("qwen3_moe", 4)
    prompt = mx.array(np.random.default_rng(9).integers(10, 4000, 200).tolist())
    steps = generate_step(
        prompt,
        model,
        max_tokens=2,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size(vault.config()),
        quantized_kv_start=0,
        prefill_step_size=CHUNK,
    )
    with pytest.raises(RuntimeError, match="quantized_matmul"):
        list(steps)
    for command in ("generate", "plan"):
        extra = ["--prompt-ids", "5,6"] if command == "generate" else ["--no-compute"]
        code, _, err = run_cli(command, vault.path, *extra, "--kv-bits", str(kv_bits))
        assert code == 1 and len(err.strip().splitlines()) == 1
        assert "--kv-bits does not run on a CUDA GPU" in err


@pytest.mark.asyncio(loop_factories=["uvloop"])  # the loop smoe runs on; GPU time is scarce
async def test_the_issues_four_slot_case_equals_mlx_lm(models):
    """The case that left mlx-lm's tokens at step 31 (issue 26): qwen2_moe --bits 4 at a
    4-slot ring, where the prompt's experts run in waves smaller than mlx-lm's call."""
    vault, model = models("qwen2_moe", 4)
    prompt = [5, 17, 99, 300, 42, 7, 250, 600]
    want, want_logits = reference(model, prompt, STEPS)
    async with Engine.open(vault.path, slots=4, **ENGINE) as engine:
        got = await generate(engine, prompt, STEPS)
        logits, _ = await engine_decode(engine, prompt, want)
    same = sum(np.array_equal(a, b) for a, b in zip(logits, want_logits, strict=True))
    report(
        {
            "test": "four_slot_case",
            "tokens_equal": got == want,
            "first_token_difference": first_difference(got, want),
            "steps_bit_identical": f"{same}/{STEPS}",
        }
    )
    assert got == want and same == STEPS


@pytest.mark.asyncio(loop_factories=["uvloop"])  # the loop smoe runs on; GPU time is scarce
@pytest.mark.parametrize("ring", ["quarter", "resident"])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("arch", ARCHS)
async def test_a_batch_of_eight_equals_each_request_alone(arch, bits, ring, models):
    """Eight concurrent greedy requests at a quarter ring, or with every expert resident
    (batched steps then built one ahead), decoded together (8 rows per pass), each equal
    to its solo run: tokens through the batcher, and every step's logits bit for bit
    through batched passes."""
    import asyncio

    from smoe.bench.resident import fill_ring
    from tests.exact.test_batching import batched_decode, solo_decode

    if bits == 16 and not CUDA:
        pytest.skip("MLX's CPU gather_mm computes float32 only")
    vault, _ = models(arch, bits)
    prompts = [
        np.random.default_rng(20 + i).integers(10, 4000, 5 + 9 * i).tolist() for i in range(8)
    ]
    slots = max(vault.manifest.shape.experts_per_token, vault.manifest.num_records // 4)
    if ring == "resident":
        slots = vault.manifest.num_records
    async with Engine.open(vault.path, slots=slots, **ENGINE) as engine:
        assert engine.plan.max_batch == 8 and engine.debug.runner.rules is not None
        if ring == "resident":
            await fill_ring(engine)
        solo = [await generate(engine, p, 24) for p in prompts]
        built = engine.debug.runner.built_ahead
        async with engine.exclusive():  # all eight are queued before the first is admitted
            runs = [asyncio.ensure_future(generate(engine, p, 24)) for p in prompts]
            await asyncio.sleep(0)
        together = await asyncio.gather(*runs)
        rows_per_pass = engine.debug.batcher.step_rows / max(1, engine.debug.batcher.steps)
        built_ahead = engine.debug.runner.built_ahead - built
        solo_logits = [await solo_decode(engine, p, 8) for p in prompts]
        batch_logits = await batched_decode(engine, prompts, 8)
    same = sum(
        np.array_equal(a, b)
        for row_a, row_b in zip(batch_logits, solo_logits, strict=True)
        for a, b in zip(row_a, row_b, strict=True)
    )
    report(
        {
            "test": "batch_of_8_vs_solo",
            "arch": arch,
            "bits": bits,
            "slots": slots,
            "ring": ring,
            "batched_passes_built_ahead": built_ahead,
            "requests_equal": sum(a == b for a, b in zip(together, solo, strict=True)),
            "first_token_differences": [
                first_difference(a, b) for a, b in zip(together, solo, strict=True)
            ],
            "rows_per_pass": round(rows_per_pass, 2),
            "logit_steps_bit_identical": f"{same}/{8 * len(prompts)}",
        }
    )
    assert together == solo and same == 8 * len(prompts) and rows_per_pass > 1
    assert ring != "resident" or built_ahead > 0


@pytest.mark.asyncio(loop_factories=["uvloop"])  # the loop smoe runs on; GPU time is scarce
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("arch", ARCHS)
async def test_drafts_equal_plain_decode(arch, bits, models):
    """--draft ngram's greedy tokens equal plain decode's, and so do an oracle's (each
    verify pass given plain decode's own next 4 tokens: all accepted), at a quarter ring."""
    from smoe.sampling import SamplingParams

    if bits == 16 and not CUDA:
        pytest.skip("MLX's CPU gather_mm computes float32 only")
    vault, _ = models(arch, bits)
    base = np.random.default_rng(31).integers(10, 4000, 40).tolist()
    prompt = base + base[:20]  # a repeat, so prompt lookup finds drafts
    slots = max(vault.manifest.shape.experts_per_token, vault.manifest.num_records // 4)
    async with Engine.open(vault.path, slots=slots, **ENGINE) as engine:
        plain = await generate(engine, prompt, STEPS)
    async with Engine.open(vault.path, slots=slots, draft="ngram", **ENGINE) as engine:
        drafted = await generate(engine, prompt, STEPS)
        stats = engine.debug.runner.drafting.stats.to_json()
        runner = engine.debug.runner

        def oracle() -> list[int]:
            seq = runner.start(prompt, SamplingParams())
            while len(seq.tokens) - len(prompt) < STEPS:
                done = len(seq.tokens) - len(prompt)
                runner.verify(seq, plain[done : done + 4])
            return seq.tokens[len(prompt) : len(prompt) + STEPS]

        by_oracle = await engine.debug.compute.run(oracle)
    report(
        {
            "test": "drafts_vs_plain",
            "arch": arch,
            "bits": bits,
            "slots": slots,
            "ngram_equal": drafted == plain,
            "ngram_first_difference": first_difference(drafted, plain),
            "ngram_accepted": stats.get("accepted"),
            "ngram_drafted": stats.get("drafted"),
            "oracle_equal": by_oracle == plain,
            "oracle_first_difference": first_difference(by_oracle, plain),
        }
    )
    assert drafted == plain and by_oracle == plain


@pytest.mark.asyncio(loop_factories=["uvloop"])  # the loop smoe runs on; GPU time is scarce
async def test_eight_requests_of_a_thousand_tokens_at_the_minimum_ring(models):
    """A bounded stress run: 8 concurrent greedy requests of 1,000 tokens each at the
    minimum ring, reads completing in shuffled order, against each request alone with
    every expert resident: not one token differs."""
    import asyncio

    vault, _ = models("qwen3_moe", 4)
    m = vault.manifest
    prompts = [
        np.random.default_rng(40 + i).integers(10, 4000, 6 + 7 * i).tolist() for i in range(8)
    ]
    n = 1000
    async with Engine.open(vault.path, slots=m.num_records, **ENGINE) as engine:
        want = [await generate(engine, p, n) for p in prompts]
    async with Engine.open(
        vault.path, slots=m.shape.experts_per_token, workers=4, **ENGINE
    ) as engine:
        shuffled = engine.debug.scheduler.wrap_backend(
            lambda inner: ShuffledReads(inner, 0, [], slow=0.0)
        )
        async with engine.exclusive():
            runs = [asyncio.ensure_future(generate(engine, p, n)) for p in prompts]
            await asyncio.sleep(0)
        got = await asyncio.gather(*runs)
        commits = engine.debug.ring.commits
        rows = engine.debug.batcher.step_rows / max(1, engine.debug.batcher.steps)
    wrong = sum(a != b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    report(
        {
            "test": "stress_8x1000_min_ring",
            "tokens": 8 * n,
            "wrong_tokens": int(wrong),
            "commits": commits,
            "rows_per_pass": round(rows, 2),
            "reordered": shuffled.finished != shuffled.started,
        }
    )
    assert wrong == 0 and shuffled.finished != shuffled.started


@pytest.mark.skipif(not CUDA, reason="a CUDA GPU's memory")
@pytest.mark.asyncio(loop_factories=["uvloop"])  # the loop smoe runs on; GPU time is scarce
async def test_a_closed_engine_gives_its_ring_back_to_the_driver(tmp_path):
    """The staged ring's banks leave the GPU when the engine closes, though the caller
    still holds the engine, and MLX's cache of freed buffers is emptied: the driver sees
    the memory free again (what a second engine, or another process, is planned with)."""
    src = synthesize(tmp_path / "hf", arch="qwen3_moe", preset="qwen3-30b-a3b", layers=1)
    vault = convert(src, tmp_path / "v", ConvertOptions(bits=16))  # 128 records of 9.4 MB
    free = lambda: int(mx.device_info(mx.gpu)["free_memory"])  # noqa: E731
    mx.clear_cache()
    before = free()
    engine = Engine.open(vault.path, slots=vault.manifest.num_records, **ENGINE)
    async with engine:
        await generate(engine, [5, 6, 7, 8], 4)
        ring, during = engine.debug.ring.nbytes, free()
    after = free()
    report(
        {"test": "closed engine", "ring": ring, "taken": before - during, "kept": before - after}
    )
    assert before - during >= ring
    assert mx.get_cache_memory() == 0 and before - after < ring // 10


@pytest.mark.skipif(not CUDA, reason="our row kernel is CUDA's")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_shared_weight_kernel_gives_every_row_its_lone_gemv_bits(dtype):
    """A batch's float Linears and LM head run all rows in one launch of our kernel
    (smoe.compute.row_gemv), which must round every row as MLX's decode-shaped call does:
    the shapes of a 235B backbone and each of the gemv's lane widths, up to 19 rows (three
    launches). The engine picks it by the same comparison when it opens."""
    from smoe.compute.row_gemv import exact_float_kernel, lone_rows, shared_weight_rows

    dt = getattr(mx, dtype)
    shapes = [(8192, 4096), (4096, 8192), (512, 4096), (128, 4096), (50000, 2048), (384, 200)]
    for n, d in shapes + [(250, 320), (100, 256)]:  # (a last warp's outputs partly past N)
        w = (mx.random.normal((n, d), key=mx.random.key(n)) * 0.05).astype(dt)
        for rows in (2, 3, 8, 16, 19):
            x = mx.random.normal((rows, d), key=mx.random.key(rows + d)).astype(dt)
            same = mx.all(shared_weight_rows(x, w) == lone_rows(x, w), axis=1)
            report(
                {
                    "test": "row kernel",
                    "dtype": dtype,
                    "shape": [n, d],
                    "rows": rows,
                    "rows_equal": int(same.sum().item()),
                }
            )
            assert same.all().item(), (n, d, rows)
    assert exact_float_kernel([dt]) == "shared"
