"""Batched decode gives every request exactly what it gets alone.

One decode pass advances several sequences of different lengths (smoe.compute.rowwise):
the MoE layers read the union of their experts once, attention runs each row on its own
cache. The logits of every row equal the solo logits bit for bit, for every architecture,
with the ring at its minimum (the union then runs in waves) and with every expert; and so
the tokens of concurrent generations and conversations equal solo ones, seeded sampling
included. The solo path itself equals mlx-lm in memory (test_engine_exact.py); one test
here also compares batched decode to mlx-lm directly.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from smoe.bench.resident import fill_ring
from smoe.compute.worker import RESIDENT
from smoe.engine import Engine
from smoe.errors import ExpertReadError
from smoe.sampling import SamplingParams
from smoe.synth import synthesize
from smoe.vault.convert import ConvertOptions, convert
from tests.exact.test_engine_exact import ARCHS, reference_decode, reference_model
from tests.fakes import FailingReads

pytestmark = pytest.mark.asyncio
PROMPT_LENGTHS = (5, 30, 70, 3)  # unequal caches; 70 prefills in two chunks
STEPS = 6


def prompts(n: int = len(PROMPT_LENGTHS)) -> list[list[int]]:
    return [
        np.random.default_rng(i).integers(2, 256, length).tolist()
        for i, length in enumerate(PROMPT_LENGTHS[:n])
    ]


@pytest.fixture(scope="module")
def vaults(hf_dir, tmp_path_factory):
    cache = {}

    def get(arch: str):
        if arch not in cache:
            root = tmp_path_factory.mktemp(f"batch-{arch}")
            cache[arch] = convert(hf_dir(arch), root / "v", ConvertOptions(dtype="float32"))
        return cache[arch]

    return get


async def solo_decode(engine: Engine, prompt: list[int], steps: int) -> list[np.ndarray]:
    """Greedy decode of one sequence alone; the logits of each step."""
    seq = await engine.debug.compute.run(engine.debug.runner.start, prompt, SamplingParams())
    out = []
    for _ in range(steps):
        out.append(await engine.debug.compute.run(engine.debug.runner.next_logits, seq))
        seq.tokens.append(int(np.argmax(out[-1])))
    return out


async def batched_decode(engine: Engine, ps: list[list[int]], steps: int) -> list[list]:
    """Greedy decode of all of ``ps`` together, one batched pass per step."""
    seqs = [
        await engine.debug.compute.run(engine.debug.runner.start, p, SamplingParams()) for p in ps
    ]
    out: list[list[np.ndarray]] = [[] for _ in ps]
    for _ in range(steps):
        logits = await engine.debug.compute.run(engine.debug.runner.next_logits_batch, seqs)
        for row, seq in enumerate(seqs):
            out[row].append(logits[row])
            seq.tokens.append(int(np.argmax(logits[row])))
    return out


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
@pytest.mark.parametrize("arch", ARCHS)
async def test_batched_step_equals_solo_bit_for_bit(arch, vaults):
    vault = vaults(arch)
    top_k = vault.manifest.shape.experts_per_token
    for ring in (dict(slots=top_k), {}):  # the minimum ring: each layer runs in waves
        async with Engine.open(vault.path, **ring) as engine:
            assert engine.debug.runner.batchable
            solo = [await solo_decode(engine, p, STEPS) for p in prompts()]
            batched = await batched_decode(engine, prompts(), STEPS)
            for row in range(len(solo)):
                for step in range(STEPS):
                    a, b = batched[row][step], solo[row][step]
                    assert np.array_equal(a, b), (ring, row, step, np.abs(a - b).max())
            assert set(engine.debug.scheduler.holders()) <= {RESIDENT}  # no request holds a slot


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])  # gpt_oss: sliding-window masks
async def test_batched_decode_equals_mlx_lm_in_memory(arch, vaults, tmp_path):
    vault = vaults(arch)
    ref = reference_model(vault, tmp_path / "mlx")
    want = [reference_decode(ref, p, STEPS)[1] for p in prompts()]
    async with Engine.open(vault.path) as engine:
        got = await batched_decode(engine, prompts(), STEPS)
    for row in range(len(want)):
        for step in range(STEPS):
            assert np.array_equal(got[row][step], want[row][step]), (row, step)


async def collect(events) -> list[int]:
    return [e.token async for e in events if e.token is not None]


SETTINGS = [
    dict(temperature=0.0),
    dict(temperature=0.9, seed=5),
    dict(temperature=0.0, repetition_penalty=1.3),
    dict(temperature=0.7, top_p=0.9, seed=11),
]


async def test_concurrent_generations_equal_solo_ones(vaults):
    """Four generate() calls at once, greedy and seeded sampling, on a ring smaller than
    their union: the tokens each would get alone (max_batch=1 runs them one by one)."""
    vault = vaults("qwen3_moe")
    top_k = vault.manifest.shape.experts_per_token
    ps = prompts()
    async with Engine.open(vault.path, max_batch=1) as engine:
        solo = [
            await collect(engine.generate(p, max_tokens=12, stop_at_eos=False, **kw))
            for p, kw in zip(ps, SETTINGS, strict=True)
        ]
        assert engine.debug.batcher.step_rows == engine.stats().batch.steps  # really one at a time
    async with Engine.open(vault.path, slots=2 * top_k) as engine:
        async with engine.exclusive():  # all four are queued before the first is admitted
            runs = [
                asyncio.ensure_future(
                    collect(engine.generate(p, max_tokens=12, stop_at_eos=False, **kw))
                )
                for p, kw in zip(ps, SETTINGS, strict=True)
            ]
            await asyncio.sleep(0)  # each task runs up to its submit, then waits
            assert engine.stats().batch.waiting == len(runs)
        assert await asyncio.gather(*runs) == solo
        assert (
            engine.debug.batcher.step_rows >= 3 * engine.stats().batch.steps
        )  # rows shared passes


async def test_concurrent_generations_with_every_expert_resident_are_built_ahead(vaults):
    """With every expert resident a batched step queues the next pass before reading its
    tokens (Runner.step_batch); the four streams, greedy and seeded, stay their solo ones
    while rows leave the batch. (A repetition penalty reads the history on the host, so a
    batch with one is not built ahead; it is left out here.)"""
    settings = [kw for kw in SETTINGS if "repetition_penalty" not in kw]
    settings.append(dict(temperature=1.1, top_k=7, seed=3))
    vault = vaults("qwen3_moe")
    every = vault.manifest.num_records
    ps = prompts()
    lengths = (12, 7, 12, 3)  # rows leave the batch at different steps
    async with Engine.open(vault.path, slots=every, max_batch=1) as engine:
        await fill_ring(engine)
        solo = [
            await collect(engine.generate(p, max_tokens=n, stop_at_eos=False, **kw))
            for p, n, kw in zip(ps, lengths, settings, strict=True)
        ]
    async with Engine.open(vault.path, slots=every) as engine:
        await fill_ring(engine)
        async with engine.exclusive():
            runs = [
                asyncio.ensure_future(
                    collect(engine.generate(p, max_tokens=n, stop_at_eos=False, **kw))
                )
                for p, n, kw in zip(ps, lengths, settings, strict=True)
            ]
            await asyncio.sleep(0)
        assert await asyncio.gather(*runs) == solo
        assert (
            engine.debug.batcher.step_rows >= 2 * engine.stats().batch.steps
        )  # rows shared passes
        assert engine.debug.runner.built_ahead >= engine.stats().batch.steps - len(ps)


async def test_generation_stats_report_the_batch(vaults):
    vault = vaults("qwen3_moe")
    ps = prompts(2)

    async def last(p):
        events = [e async for e in engine.generate(p, max_tokens=5, stop_at_eos=False)]
        return events[-1].stats

    async with Engine.open(vault.path) as engine:
        async with engine.exclusive():
            runs = [asyncio.ensure_future(last(p)) for p in ps]
            await asyncio.sleep(0)
            assert engine.stats().batch.waiting == 2
        stats = await asyncio.gather(*runs)
    for s in stats:
        assert s.generated_tokens == 5 and s.decode_batch_mean > 1
        assert s.prefilled_tokens in (len(ps[0]) - 1, len(ps[1]) - 1)


async def test_concurrent_conversations_equal_solo_ones(tmp_path):
    vault = convert(
        synthesize(tmp_path / "src", arch="qwen3_moe", preset="tiny", seed=3),
        tmp_path / "v",
        ConvertOptions(dtype="float32"),
    )
    turns = [["Hello there", "Tell me more"], ["What is a vault?", "Why?"], ["Hi", "Bye"]]

    async def chat(engine, lines):
        conv = engine.conversation(system="Be brief.")
        return [
            "".join([e.text async for e in conv.send(line, max_tokens=8)]) for line in lines
        ], conv.tokens

    async with Engine.open(vault.path, max_batch=1) as engine:
        solo = [await chat(engine, lines) for lines in turns]
    async with Engine.open(vault.path) as engine:
        assert await asyncio.gather(*(chat(engine, lines) for lines in turns)) == solo
        assert engine.debug.batcher.step_rows > engine.stats().batch.steps


async def test_a_failed_batched_pass_resets_its_sequences(vaults):
    """A pass that fails half-way leaves layers out of step; the sequences start over
    (their next use prefills again) instead of decoding from a corrupt cache."""
    vault = vaults("qwen3_moe")
    # The smallest ring: a pass's first MoE layer always misses, so its read fails after
    # attention ran (the backbone layers are out of step with the MoE ones).
    async with Engine.open(vault.path, slots=4) as engine:
        r = engine.debug.runner
        disk = engine.debug.scheduler.wrap_backend(FailingReads)
        seqs = [await engine.debug.compute.run(r.start, p, SamplingParams()) for p in prompts(2)]
        disk.failing = True
        with pytest.raises(ExpertReadError, match="disk gone"):
            await engine.debug.compute.run(r.step_batch, seqs)
        assert disk.failed > 0
        disk.failing = False
        assert all(s.cached == 0 and s.to_prefill() == len(s.tokens) - 1 for s in seqs)
        alone = await solo_decode(engine, prompts(1)[0], 1)
        for seq in seqs:
            while await engine.debug.compute.run(r.prefill_chunk, seq):
                pass
        again = await engine.debug.compute.run(r.next_logits_batch, seqs)
        assert np.array_equal(again[0], alone[0])


async def test_a_batched_step_asks_for_each_layers_union_once(vaults):
    """The point of batching: per MoE layer, the experts the rows share are asked for (and
    read) once. The scheduler sees exactly the union of the rows' experts, no more."""
    vault = vaults("qwen3_moe")  # 8 experts, top-2: four rows overlap
    async with Engine.open(vault.path, lookahead=False) as engine:
        r = engine.debug.runner
        seqs = [await engine.debug.compute.run(r.start, p, SamplingParams()) for p in prompts()]
        routed: list[np.ndarray] = []
        engine.debug.tracer.observers.on_routing = lambda layer, idx: routed.append(idx)
        stats = engine.stats().scheduler
        asked0 = stats.hits + stats.misses
        await engine.debug.compute.run(r.step_batch, seqs)
        asked = stats.hits + stats.misses - asked0
        engine.debug.tracer.observers.on_routing = None
    assert all(idx.shape[0] == len(seqs) for idx in routed)  # one call per layer, B rows
    unions = [len(np.unique(idx)) for idx in routed]
    per_row = [sum(len(set(row)) for row in idx) for idx in routed]
    assert asked == sum(unions) < sum(per_row)


class AttentionCalls:
    """How many RoPE and attention kernels, and projections, a pass calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import mlx.core as mx
        import mlx.nn as nn

        self.counts = {"rope": 0, "sdpa": 0, "projection": 0}
        rope, sdpa = mx.fast.rope, mx.fast.scaled_dot_product_attention
        linear = nn.Linear.__call__

        def counted(name, f):
            def call(*args, **kwargs):
                self.counts[name] += 1
                return f(*args, **kwargs)

            return call

        monkeypatch.setattr(mx.fast, "rope", counted("rope", rope))
        monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", counted("sdpa", sdpa))
        monkeypatch.setattr(nn.Linear, "__call__", counted("projection", linear))
        # On the CPU the engine's projections run our kernels (smoe.compute.native):
        # count those calls too (a wrapped layer calls its inner one only where they
        # do not take the call, which these float32 models never do).
        from smoe.compute.native import NativeLinear

        native = NativeLinear.__call__
        monkeypatch.setattr(NativeLinear, "__call__", counted("projection", native))

    async def of_a_pass(self, engine: Engine, rows: int) -> dict[str, int]:
        r = engine.debug.runner
        ps = prompts(rows) if rows <= len(PROMPT_LENGTHS) else [[3, 4 + i] for i in range(rows)]
        seqs = [await engine.debug.compute.run(r.start, p, SamplingParams()) for p in ps]
        self.counts = dict.fromkeys(self.counts, 0)
        await engine.debug.compute.run(r.next_logits_batch, seqs)
        return dict(self.counts)


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
async def test_a_batch_runs_only_the_cache_and_the_attention_per_row(arch, vaults, monkeypatch):
    """The projections and RoPE of a batched pass's attention are one call per layer
    whatever the rows (a row adds its cache update and attention only); DeepSeek-V3's latent attention,
    which computes on the fetched keys, runs its whole module per row instead."""
    vault = vaults(arch)
    calls = AttentionCalls(monkeypatch)
    # (Lookahead off: it runs the next layer's router on the batch, a call more.)
    async with Engine.open(vault.path, lookahead=False) as engine:
        two, four = await calls.of_a_pass(engine, 2), await calls.of_a_pass(engine, 4)
    layers = len(vault.manifest.layers)
    assert four["sdpa"] == 2 * two["sdpa"] > 0
    if arch == "deepseek_v3":
        assert four["projection"] > two["projection"]  # its attention's, once per row
        return
    assert four["rope"] == two["rope"] == 2 * layers  # queries and keys, each row its offset
    assert four["projection"] == two["projection"]  # the rows share every projection call
