"""One greedy request, one answer: mlx-lm's, whichever path the engine takes while it runs.

A server switches paths under a request in flight: its idle pre-warm fills the ring, the
ring then pins every expert for good and serves layers from device tables (decode built
one step ahead); requests join and leave the batch between steps; the prefix cache hands
a request another's KV cache; a neighbour's GPU memory shrinks the default ring. On a GPU
MLX picks kernels by a call's shape, so each path must shape its calls as the reference
does (smoe.compute.solo_rows). Each switch is forced here at a chosen point, for every
synthesized architecture at 4 and 16 bits, and each request's tokens compared with
mlx-lm's in memory (the replay of a report: gpt_oss, 16-bit vault, a GPU server, request
4 of 8 got another text when sent with the others; one request's two solo runs differed).

SMOE_GPU_PATH_ARCHS / SMOE_GPU_PATH_BITS (comma lists) pick a subset; SMOE_GPU_REPORT
gets a JSON line per case.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys

import aiohttp
import mlx.core as mx
import numpy as np
import pytest

from smoe.engine import Engine
from tests.gpu.gpu_common import (
    CUDA,
    ENGINE,
    GPU_MARKS,
    SYNTH_ARCHS,
    first_difference,
    generate,
    reference,
    report,
)

pytestmark = GPU_MARKS

ARCHS = os.environ.get("SMOE_GPU_PATH_ARCHS", ",".join(SYNTH_ARCHS)).split(",")
BITS = [int(b) for b in os.environ.get("SMOE_GPU_PATH_BITS", "4,16").split(",")]
TOKENS = 32


def the_prompts(vocab: int) -> list[list[int]]:
    """The report's eight prompts: 5 to 68 token ids."""
    top = min(4000, vocab)
    return [np.random.default_rng(20 + i).integers(10, top, 5 + 9 * i).tolist() for i in range(8)]


async def permuted_fill(engine: Engine, seed: int) -> None:
    """Read every expert into the ring in a shuffled order (layers interleaved), as no
    demand would: the slots then hold the experts in an order of their own, and the next
    request pins them all and runs from device tables."""
    m = engine.vault.manifest
    keys = [(spec.layer, e) for spec in m.layers for e in range(m.num_experts)]
    random.Random(seed).shuffle(keys)
    scheduler = engine.debug.scheduler
    for layer, expert in keys:
        scheduler.release(await scheduler.acquire(layer, [expert]))


class Cases:
    """Each case's tokens per request, against mlx-lm's; reported and judged at the end."""

    def __init__(self, arch: str, bits: int, want: list[list[int]]) -> None:
        self.arch, self.bits, self.want = arch, bits, want
        self.wrong: dict[str, dict[int, int | None]] = {}

    def check(self, case: str, got: dict[int, list[int]], **facts) -> None:
        diffs = {i: first_difference(tokens, self.want[i]) for i, tokens in got.items()}
        equal = sum(d is None for d in diffs.values())
        report(
            {
                "test": "paths",
                "arch": self.arch,
                "bits": self.bits,
                "case": case,
                "requests_equal": f"{equal}/{len(got)}",
                "first_differences": {str(i): d for i, d in diffs.items() if d is not None},
                **facts,
            }
        )
        if equal != len(got):
            self.wrong[case] = {i: d for i, d in diffs.items() if d is not None}


def _skip_float_on_cpu(bits: int) -> None:
    if bits == 16 and not CUDA:
        pytest.skip("MLX's CPU gather_mm computes float32 only")


@pytest.mark.asyncio(loop_factories=["uvloop"])  # the loop smoe runs on; GPU time is scarce
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("arch", ARCHS)
async def test_a_greedy_request_gets_mlx_lms_tokens_on_every_path(arch, bits, models):
    _skip_float_on_cpu(bits)
    vault, model = models(arch, bits)
    prompts = the_prompts(int(vault.config()["vocab_size"]))
    want = [reference(model, p, TOKENS)[0] for p in prompts]
    cases = Cases(arch, bits, want)
    everyone = range(len(prompts))

    # 1. Alone, in order, the ring filling with each request's experts (reads in flight).
    async with Engine.open(vault.path, **ENGINE) as engine:
        assert engine.stats().ring.slots == vault.manifest.num_records  # the default here
        got = {i: await generate(engine, prompts[i], TOKENS) for i in everyone}
        cases.check("alone, ring filling", got)
        # 2. Every expert in, read in a shuffled order: pinned, device tables, built ahead.
        await permuted_fill(engine, seed=1)
        built = engine.debug.runner.built_ahead
        got = {i: await generate(engine, prompts[i], TOKENS) for i in everyone}
        cases.check("alone, resident", got, built_ahead=engine.debug.runner.built_ahead - built)
        # 3. All eight at once on the resident ring (batched passes built ahead).
        async with engine.exclusive():  # all are queued before the first is admitted
            runs = [asyncio.ensure_future(generate(engine, p, TOKENS)) for p in prompts]
            await asyncio.sleep(0)
        together = await asyncio.gather(*runs)
        cases.check("eight at once, resident", dict(enumerate(together)))

    # 4. The ring fills and pins while a request is in flight: during its prompt, and
    # after its first or tenth token (the switch from reserving calls to device tables).
    for point in ("prompt", 1, 10):
        async with Engine.open(vault.path, **ENGINE) as engine:
            i = 4  # the report's request
            if point == "prompt":
                tokens, _ = await asyncio.gather(
                    generate(engine, prompts[i], TOKENS), permuted_fill(engine, seed=2)
                )
            else:

                async def switch(n: int, at: int = point) -> None:
                    if n == at:
                        await permuted_fill(engine, seed=3)

                tokens = await generate(engine, prompts[i], TOKENS, after=switch)
            resident = engine.debug.slots.all_resident(len(vault.manifest.layers))
            cases.check(f"ring pinned mid-request ({point})", {i: tokens}, resident=resident)

    # 5. All eight at once on a cold ring (reads in flight), then staggered: request j
    # joins when request 0 has made 3j tokens, so the batch changes under every request.
    async with Engine.open(vault.path, **ENGINE) as engine:
        async with engine.exclusive():
            runs = [asyncio.ensure_future(generate(engine, p, TOKENS)) for p in prompts]
            await asyncio.sleep(0)
        cases.check("eight at once, cold", dict(enumerate(await asyncio.gather(*runs))))
    async with Engine.open(vault.path, **ENGINE) as engine:
        later: dict[int, asyncio.Future] = {}

        async def join(n: int) -> None:
            if n % 3 == 0 and n // 3 < len(prompts):
                j = n // 3
                later[j] = asyncio.ensure_future(generate(engine, prompts[j], TOKENS))
                await asyncio.sleep(0)

        first = await generate(engine, prompts[0], TOKENS, after=join)
        got = {0: first, **{j: await f for j, f in later.items() if j}}
        cases.check("staggered joins", got, rows_per_pass=_rows_per_pass(engine))

    # 6. A smaller ring: half the experts, and the smallest (layers in waves).
    for name, slots in (
        ("half ring", vault.manifest.num_records // 2),
        ("smallest ring", vault.manifest.shape.experts_per_token),
    ):
        async with Engine.open(vault.path, slots=slots, **ENGINE) as engine:
            got = {i: await generate(engine, prompts[i], TOKENS) for i in (0, 4, 7)}
            cases.check(name, got)

    assert not cases.wrong, cases.wrong  # every case is run and reported first


def _rows_per_pass(engine: Engine) -> float:
    batcher = engine.debug.batcher
    return round(batcher.step_rows / max(1, batcher.steps), 2)


@pytest.mark.asyncio(loop_factories=["uvloop"])  # the loop smoe runs on; GPU time is scarce
@pytest.mark.parametrize("bits", BITS)
async def test_the_reported_server_scenario(bits, models):
    """The report itself, through `smoe serve`'s code on a real socket: eight
    /v1/completions requests (32 tokens, temperature 0, ignore_eos) each alone, then all at
    once, then each alone again, with the idle pre-warm on and no prefix cache; then with
    the prefix cache on, each again and each extended by its own first 8 tokens (a prefix
    hit: its KV then holds those tokens as decode steps made them, so its reply is mlx-lm's
    decode of the prompt, continued). Every text is its first solo text, and that text is
    mlx-lm's tokens decoded."""
    from smoe.serve.app import ServerOptions
    from tests.serving import Running

    _skip_float_on_cpu(bits)
    arch = os.environ.get("SMOE_GPU_SCENARIO_ARCH", "gpt_oss")
    vault, model = models(arch, bits)
    prompts = the_prompts(int(vault.config()["vocab_size"]))
    longer = [reference(model, p, TOKENS + 8)[0] for p in prompts]  # greedy: want's prefix
    want = [w[:TOKENS] for w in longer]
    rounds: dict[str, list[str]] = {}

    async def ask(base: str, prompt: list[int]) -> str:
        body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{base}/v1/completions", json=body) as r,
        ):
            assert r.status == 200, await r.text()
            return str((await r.json())["choices"][0]["text"])

    async with Engine.open(vault.path, **ENGINE) as engine:
        decode = engine.tokenizer.decode
        opts = ServerOptions(cached_sequences=0, prewarm_when_idle=True)
        async with Running(engine, opts) as srv:
            client = srv.base
            rounds["alone"] = [await ask(client, p) for p in prompts]
            rounds["all at once"] = list(await asyncio.gather(*(ask(client, p) for p in prompts)))
            rounds["alone again"] = [await ask(client, p) for p in prompts]
    async with (
        Engine.open(vault.path, **ENGINE) as engine,
        Running(engine, ServerOptions(prewarm_when_idle=True)) as srv,
    ):
        client = srv.base
        rounds["prefix cache"] = [await ask(client, p) for p in prompts]
        rounds["prefix cache, repeated"] = [await ask(client, p) for p in prompts]
        extended = [p + w[:8] for p, w in zip(prompts, want, strict=True)]
        tails = [await ask(client, p) for p in extended]
    first = rounds["alone"]
    differ = {
        name: [i for i, (a, b) in enumerate(zip(texts, first, strict=True)) if a != b]
        for name, texts in rounds.items()
    }
    # A completion's text is exactly the tokenizer's decoding of its ids (leading space
    # included: tests/system/test_serve_text.py), so texts compare as they are.
    vs_mlx = [i for i, t in enumerate(first) if t != decode(want[i])]
    # An extended prompt reuses the cached request's KV, its first 8 tokens' included, as
    # they were made (decode steps): its reply is mlx-lm's decode of the prompt continued.
    vs_ext = [i for i, t in enumerate(tails) if t != decode(longer[i][8:])]
    report(
        {
            "test": "server scenario",
            "arch": arch,
            "bits": bits,
            "rounds_differing_from_first": differ,
            "first_round_vs_mlx_lm": vs_mlx,
            "extended_vs_mlx_lm": vs_ext,
        }
    )
    assert not any(differ.values()) and not vs_mlx and not vs_ext, (differ, vs_mlx, vs_ext)


# The neighbour: holds GPU memory, then multiplies on the GPU until its stdin closes.
NEIGHBOUR = """
import sys, threading, mlx.core as mx
held = [mx.zeros((min(1 << 30, {hold} - i),), mx.uint8) for i in range(0, {hold}, 1 << 30)]
mx.eval(held)
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
print("held", flush=True)
x = mx.random.normal((4096, 4096)).astype(mx.bfloat16)
while not stop.is_set():
    mx.eval(x @ x)
"""


@pytest.mark.skipif(not CUDA, reason="a CUDA GPU's memory, shared with another process")
@pytest.mark.asyncio(loop_factories=["uvloop"])  # the loop smoe runs on; GPU time is scarce
@pytest.mark.parametrize("bits", BITS)
async def test_a_neighbour_holding_gpu_memory_changes_the_ring_not_the_tokens(bits, models):
    """A second process takes GPU memory until the default ring holds about half the
    experts, and keeps the GPU busy; requests alone and eight at once still get mlx-lm's
    tokens."""
    from smoe.plan.ring import Device, current_device, plan_ring

    arch = os.environ.get("SMOE_GPU_SCENARIO_ARCH", "gpt_oss")
    vault, model = models(arch, bits)
    prompts = the_prompts(int(vault.config()["vocab_size"]))
    want = [reference(model, p, TOKENS)[0] for p in prompts]
    m = vault.manifest

    def slots_at(free: int) -> int:
        device = Device(gpu=True, discrete=True, free_memory=free)
        try:
            return plan_ring(vault, requested="staged", dtype=mx.bfloat16, device=device).slots
        except Exception:
            return 0

    low, high = 1, current_device(mx.gpu).free_memory or 0
    while high - low > 1 << 20:  # the free memory that leaves half the experts a ring
        mid = (low + high) // 2
        low, high = (mid, high) if slots_at(mid) < m.num_records // 2 else (low, mid)
    mx.clear_cache()
    hold = (current_device(mx.gpu).free_memory or 0) - high
    code = NEIGHBOUR.format(hold=hold)
    neighbour = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert neighbour.stdout is not None
        assert (await neighbour.stdout.readline()).strip() == b"held"
        async with Engine.open(vault.path, **ENGINE) as engine:
            slots = engine.stats().ring.slots
            alone = {i: await generate(engine, prompts[i], TOKENS) for i in range(len(prompts))}
            async with engine.exclusive():
                runs = [asyncio.ensure_future(generate(engine, p, TOKENS)) for p in prompts]
                await asyncio.sleep(0)
            together = dict(enumerate(await asyncio.gather(*runs)))
    finally:
        await neighbour.communicate(b"")
    cases = Cases(arch, bits, want)
    cases.check("neighbour: alone", alone, slots=slots, held=hold)
    cases.check("neighbour: eight at once", together, slots=slots)
    assert slots < m.num_records and not cases.wrong, (slots, cases.wrong)
