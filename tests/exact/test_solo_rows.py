"""One row, one arithmetic (smoe.compute.solo_rows), forced on the CPU.

On a GPU a row's bits depend on how many rows share its kernel call; the engine then
shapes batched and verify passes so each row gets the kernel its solo decode step gets
(docs/gpu.md). The CPU's kernels compute rows alone anyway, so here the path is forced
(``solo_rows=True``: CUDA's measured rules) and two things are checked:

- the shapes: every MLX call of a batched pass, a verify pass and the waves of a small
  ring has the kernel class its reference call has (recorded at the MLX functions), and
  without the path it would not;
- the plumbing: solo, batched and drafted runs stay bit-identical through the pieces,
  the padding and the one-row-at-a-time attention, for each architecture's modules.

The engines here run MLX's own CPU kernels (``cpu_kernels="mlx"``): the tests count
MLX's calls, which S-MoE's native kernels replace on the CPU where no rules apply.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from smoe.bench.resident import fill_ring
from smoe.compute import row_gemv
from smoe.compute import solo_rows as solo_rows_module
from smoe.compute.solo_rows import CUDA, RowPieces, RowPiecesEmbedding, expert_call, solo_rows
from smoe.engine import Engine
from smoe.sampling import SamplingParams
from smoe.vault.convert import ConvertOptions, convert
from tests.conftest import make_hf_checkpoint
from tests.exact.test_batching import batched_decode, prompts, solo_decode

VECTOR_BELOW = CUDA.vector_below  # 8: quantized calls below it run the per-row vector kernel
# CUDA's rules as the engine opens them on the CPU: the probe finds MLX's batched gemv
# (row_gemv.strided_rows) gives lone-row bits there; our CUDA kernel does not run.
CPU_RULES = dataclasses.replace(CUDA, float_kernel="strided")
STEPS = 4


class Calls:
    """The rows of every MLX matmul call made while recording, by op."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: dict[str, list[int]] = {}
        self.sorted_gathers = 0
        self.on = False
        for op in ("gather_qmm", "quantized_matmul", "gather_mm"):
            self._wrap(monkeypatch, op)
        linear_call = nn.Linear.__call__

        def linear(module: nn.Linear, x: mx.array) -> mx.array:
            self._note("float_dense", x.size // x.shape[-1])
            return linear_call(module, x)

        monkeypatch.setattr(nn.Linear, "__call__", linear)
        as_linear = nn.Embedding.as_linear

        def tied(module: nn.Embedding, x: mx.array) -> mx.array:
            self._note("float_dense", x.size // x.shape[-1])
            return as_linear(module, x)

        monkeypatch.setattr(nn.Embedding, "as_linear", tied)

    def _note(self, op: str, rows: int) -> None:
        if self.on:
            self.rows.setdefault(op, []).append(rows)

    def _wrap(self, monkeypatch: pytest.MonkeyPatch, op: str) -> None:
        original = getattr(mx, op)

        def recorded(*args, **kwargs):
            out = original(*args, **kwargs)
            self._note(op, out.size // out.shape[-1])  # output rows: M x batch
            if op == "gather_mm" and kwargs.get("sorted_indices") and self.on:
                self.sorted_gathers += 1
            return out

        monkeypatch.setattr(mx, op, recorded)


def _checkpoint(root, top_k: int, **extra):
    """A qwen3_moe checkpoint of 16 experts routing ``top_k`` (saved by transformers)."""
    return make_hf_checkpoint(
        root / f"hf-{top_k}",
        "qwen3_moe",
        num_experts=16,
        num_experts_per_tok=top_k,
        moe_intermediate_size=64,
        **extra,
    )


@pytest.fixture(scope="module")
def vaults(tmp_path_factory):
    """(top_k, bits, backbone bits, tied head) -> vault, built once per module."""
    made = {}

    def get(top_k: int, bits: int = 4, backbone_bits: int | None = None, tied: bool = False):
        key = (top_k, bits, backbone_bits, tied)
        if key not in made:
            root = tmp_path_factory.mktemp(f"solo-{top_k}-{bits}-{backbone_bits}-{tied}")
            extra = {"tie_word_embeddings": True} if tied else {}
            src = _checkpoint(root, top_k, **extra)
            options = ConvertOptions(bits=bits, dtype="float32", backbone_bits=backbone_bits)
            made[key] = convert(src, root / "v", options)
        return made[key]

    return get


async def _batched_calls(engine: Engine, calls: Calls, n: int = 4) -> dict[str, list[int]]:
    """The calls of one batched decode pass of ``n`` sequences (prefill not recorded)."""
    runner = engine.debug.runner
    ps = [np.random.default_rng(30 + i).integers(2, 256, 3 + 5 * i).tolist() for i in range(n)]
    seqs = [await engine.debug.compute.run(runner.start, p, SamplingParams()) for p in ps]
    calls.rows.clear()
    calls.on = True
    try:
        await engine.debug.compute.run(runner.next_logits_batch, seqs)
    finally:
        calls.on = False
    return dict(calls.rows)


# ----------------------------------------------------------------------------- the shapes
@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
async def test_a_batched_pass_keeps_every_call_in_its_solo_kernel_class(vaults, monkeypatch):
    """top-2 (a solo step's gathers run the vector kernel): under the rules every quantized
    call of a batch of 4 has fewer than 8 rows and every float dense call one row;
    without them the same pass makes larger calls (what changed tokens on the H200)."""
    calls = Calls(monkeypatch)
    vault = vaults(2, backbone_bits=8, tied=False)
    async with Engine.open(vault.path, solo_rows=True, cpu_kernels="mlx") as engine:
        assert engine.debug.runner.rules == CPU_RULES
        got = await _batched_calls(engine, calls)
        nine = await _batched_calls(engine, calls, n=9)  # attention's projections: 7 + 2
    assert got["gather_qmm"] and max(got["gather_qmm"]) < VECTOR_BELOW
    assert got["quantized_matmul"] and max(got["quantized_matmul"]) < VECTOR_BELOW
    assert max(nine["quantized_matmul"]) == VECTOR_BELOW - 1
    async with Engine.open(vault.path, solo_rows=False, cpu_kernels="mlx") as engine:
        assert engine.debug.runner.rules is None
        plain = await _batched_calls(engine, calls)
    assert max(plain["gather_qmm"]) >= VECTOR_BELOW  # 4 sequences x 2 ranks x ... rows


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
async def test_float_dense_calls_and_a_tied_head_keep_lone_row_kernels(vaults, monkeypatch):
    """A batch's float Linears and tied head run in one launch of the probed row kernel
    (row_gemv), all rows at once; where the probe finds none, one row per call.
    (Lookahead off: it runs the next layer's router on the whole batch, for the reads
    it queues, not for any row's result.)"""
    calls = Calls(monkeypatch)
    strided = row_gemv.FLOAT_KERNELS["strided"]

    def recorded(x: mx.array, w: mx.array) -> mx.array:
        calls._note("row_kernel", x.shape[0])
        return strided(x, w)

    monkeypatch.setitem(row_gemv.FLOAT_KERNELS, "strided", recorded)
    vault = vaults(2, tied=True)  # float backbone, LM head = the embedding's as_linear
    async with Engine.open(
        vault.path, solo_rows=True, lookahead=False, cpu_kernels="mlx"
    ) as engine:
        got = await _batched_calls(engine, calls)
    assert set(got["row_kernel"]) == {4} and "float_dense" not in got
    monkeypatch.setattr(solo_rows_module, "exact_float_kernel", lambda dtypes: None)
    async with Engine.open(
        vault.path, solo_rows=True, lookahead=False, cpu_kernels="mlx"
    ) as engine:
        assert engine.debug.runner.rules == CUDA
        pieces = await _batched_calls(engine, calls)
    assert set(pieces["float_dense"]) == {1} and "row_kernel" not in pieces
    async with Engine.open(
        vault.path, solo_rows=False, lookahead=False, cpu_kernels="mlx"
    ) as engine:
        plain = await _batched_calls(engine, calls)
    assert max(plain["float_dense"]) == 4


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
async def test_waves_keep_the_tiled_kernel_of_a_top8_call(vaults, monkeypatch):
    """top-8 (a solo step's gathers already run the tiled kernel): at the minimum ring a
    prompt's union runs in waves and a batch's in parts; every part is padded to 8 rows
    so it keeps the kernel of the call mlx-lm makes. Without the rules some parts are
    smaller (the H200's 4-slot divergence at step 31)."""
    calls = Calls(monkeypatch)
    vault = vaults(8)
    prompt = prompts(1)[0]
    for forced, check in ((True, min), (False, None)):
        async with Engine.open(vault.path, slots=8, solo_rows=forced, cpu_kernels="mlx") as engine:
            calls.rows.clear()
            calls.on = True
            try:
                seq = await engine.debug.compute.run(
                    engine.debug.runner.start, prompt, SamplingParams()
                )
                await engine.debug.compute.run(engine.debug.runner.next_logits, seq)
            finally:
                calls.on = False
            rows = calls.rows["gather_qmm"]
            if check is not None:
                assert check(rows) >= VECTOR_BELOW, rows
            else:
                assert min(rows) < VECTOR_BELOW, rows


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
@pytest.mark.parametrize(("top_k", "bits"), [(2, 4), (8, 4), (8, 16)])
async def test_a_lone_request_makes_the_same_calls_with_and_without_the_rules(
    vaults, monkeypatch, top_k, bits
):
    """What the rules cost one request (bench/solo_rows_cost.py measures it on a GPU): a
    lone decode step's calls already have its reference's shapes, so with every expert
    resident the rules change no call: the same ops with the same rows, in the same order."""
    calls = Calls(monkeypatch)
    vault = vaults(top_k, bits=bits, backbone_bits=8)
    prompt = prompts(1)[0]
    seen = []
    for forced in (True, False):
        every = vault.manifest.num_records
        async with Engine.open(
            vault.path, slots=every, solo_rows=forced, cpu_kernels="mlx"
        ) as engine:
            await fill_ring(engine)
            seq = await engine.debug.compute.run(
                engine.debug.runner.start, prompt, SamplingParams()
            )
            calls.rows.clear()
            calls.on = True
            try:
                for _ in range(STEPS):
                    await engine.debug.compute.run(engine.debug.runner.step, seq)
            finally:
                calls.on = False
            seen.append((dict(calls.rows), list(seq.tokens)))
    (ruled, ruled_tokens), (plain, plain_tokens) = seen
    assert ruled and ruled == plain
    assert ruled_tokens == plain_tokens


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
async def test_float_gathers_stay_unsorted_in_a_batch(vaults, monkeypatch):
    """Float experts: mlx-lm sorts a call from 64 rows, which on CUDA runs a grouped GEMM;
    a decode step's small call is unsorted. A batch of 8 sequences of top-8 (64 rows)
    under the rules stays unsorted."""
    calls = Calls(monkeypatch)
    vault = vaults(8, bits=16)
    async with Engine.open(vault.path, solo_rows=True, cpu_kernels="mlx") as engine:
        await _batched_calls(engine, calls, n=8)
        assert calls.sorted_gathers == 0
    async with Engine.open(vault.path, solo_rows=False, cpu_kernels="mlx") as engine:
        await _batched_calls(engine, calls, n=8)
        assert calls.sorted_gathers > 0


def test_expert_call_pieces_and_padding_return_each_row_in_place():
    """The splitting and the padding give back exactly the single call's rows."""
    from mlx_lm.models.switch_layers import SwitchGLU

    mx.random.seed(3)
    module = SwitchGLU(64, 64, 12)
    nn.quantize(module, group_size=64, bits=4)
    x = mx.random.normal((5, 1, 64))
    idx = mx.array(np.random.default_rng(4).integers(0, 12, (5, 1, 3)).astype(np.uint32))
    whole = module(x, idx)  # [5, 1, 3, 64]
    with solo_rows(CUDA):  # reference 3 rows (vector): pieces of 7 of the 15 rows
        pieces = expert_call(module, x, idx, CUDA, reference_rows=3)
    padded = expert_call(module, x[:1], idx[:1], CUDA, reference_rows=64)  # 3 rows -> 8
    assert np.array_equal(np.array(pieces), np.array(whole))
    assert np.array_equal(np.array(padded), np.array(whole[:1]))


def test_row_pieces_keep_a_router_tuple_and_the_leading_shape():
    class Router(nn.Module):  # DeepSeek's MoEGate returns (indices, scores)
        def __init__(self) -> None:
            super().__init__()
            self.weight = mx.random.normal((6, 16))

        def __call__(self, x):
            g = x @ self.weight.T
            return mx.argmax(g, axis=-1, keepdims=True), mx.max(g, axis=-1, keepdims=True)

    router = Router()
    wrapped = RowPieces(router)
    x = mx.random.normal((3, 2, 16))
    with solo_rows(CUDA):
        got = wrapped(x)
    want = router(x)
    assert [g.shape for g in got] == [w.shape for w in want] == [(3, 2, 1), (3, 2, 1)]
    assert all(np.array_equal(np.array(g), np.array(w)) for g, w in zip(got, want, strict=True))
    emb = nn.Embedding(10, 16)
    tied = RowPiecesEmbedding(emb)
    with solo_rows(CUDA):
        head = tied.as_linear(x)
    assert np.array_equal(np.array(tied(mx.array([1, 2]))), np.array(emb(mx.array([1, 2]))))
    assert np.array_equal(np.array(head), np.array(emb.as_linear(x)))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("dim", [256, 320, 200])  # MLX's gemv: 4, 2, 1 elements per lane
def test_strided_rows_give_each_row_its_lone_bits(dtype, dim):
    """MLX's batched gemv path: [R, 1, D] strided as transposed computes each row as its
    decode-shaped [1, 1, D] call does (the GPU test checks the same on CUDA)."""
    w = (mx.random.normal((40, dim), key=mx.random.key(1)) * 0.05).astype(dtype)
    for rows in (2, 7, 19):
        x = mx.random.normal((rows, dim), key=mx.random.key(rows)).astype(dtype)
        got = row_gemv.strided_rows(x, w)
        assert got.shape == (rows, 40) and got.dtype == dtype
        assert mx.array_equal(got, row_gemv.lone_rows(x, w)).item()


def test_the_probe_takes_the_first_kernel_that_gives_lone_bits(monkeypatch):
    """Preferred order, a kernel the backend lacks (ours, off CUDA) skipped, and one whose
    bits differ in any probed dtype refused; none matching leaves one call per row."""
    assert row_gemv.exact_float_kernel([mx.float32, mx.bfloat16]) == "strided"

    def off_in_bf16(x: mx.array, w: mx.array) -> mx.array:  # a cuBLAS-like stand-in
        y = row_gemv.strided_rows(x, w)
        return y if y.dtype != mx.bfloat16 else y * (1 + 2**-6)

    kernels = {"bad": off_in_bf16, "ok": row_gemv.strided_rows}
    monkeypatch.setattr(row_gemv, "FLOAT_KERNELS", kernels)
    assert row_gemv.exact_float_kernel([mx.float32]) == "bad"
    assert row_gemv.exact_float_kernel([mx.float32, mx.bfloat16]) == "ok"
    monkeypatch.setattr(row_gemv, "FLOAT_KERNELS", {"bad": off_in_bf16})
    assert row_gemv.exact_float_kernel([mx.bfloat16]) is None


def test_a_float_linear_and_a_tied_head_run_all_rows_in_one_row_kernel_call():
    """Inside the rules a bias-free float Linear's rows, whatever the leading shape, go
    through the kernel at once; a biased one (cuBLAS even for one row) keeps pieces."""
    rules = dataclasses.replace(CUDA, float_kernel="strided")
    x = mx.random.normal((3, 2, 16), key=mx.random.key(5))
    plain, biased = nn.Linear(16, 6, bias=False), nn.Linear(16, 6)
    emb = nn.Embedding(10, 16)
    with solo_rows(rules):
        got = RowPieces(plain)(x), RowPieces(biased)(x), RowPiecesEmbedding(emb).as_linear(x)
    want = plain(x), biased(x), emb.as_linear(x)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and mx.array_equal(g, w).item()


# ---------------------------------------------------------------------------- the bits
@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "deepseek_v2", "gpt_oss"])
async def test_batched_equals_solo_bit_for_bit_through_the_pieces(arch, hf_dir, tmp_path):
    """qwen2_moe: a shared expert and its gate; deepseek_v2: a MoEGate router and a dense
    first layer; gpt_oss: biased Linears and sliding-window masks."""
    vault = convert(hf_dir(arch), tmp_path / "v", ConvertOptions(dtype="float32"))
    top_k = vault.manifest.shape.experts_per_token
    for ring in (dict(slots=top_k), {}):
        async with Engine.open(vault.path, solo_rows=True, **ring, cpu_kernels="mlx") as engine:
            assert engine.debug.runner.batchable and engine.debug.runner.rules == CPU_RULES
            solo = [await solo_decode(engine, p, STEPS) for p in prompts()]
            batched = await batched_decode(engine, prompts(), STEPS)
        for row in range(len(solo)):
            for step in range(STEPS):
                a, b = batched[row][step], solo[row][step]
                assert np.array_equal(a, b), (arch, ring, row, step, np.abs(a - b).max())


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
@pytest.mark.parametrize("slots", [2, None], ids=["min", "all"])
async def test_drafted_equals_plain_with_attention_one_row_at_a_time(vaults, slots):
    """A verify pass under the rules runs attention one row after another (each row's
    keys and values appended first, as in its decode step) and the rest in pieces: its
    logits are plain decode's, bit for bit, and so its greedy tokens."""
    vault = vaults(2)
    prompt = [3, 17, 40, 9, 22, 61, 5, 12] * 3
    async with Engine.open(
        vault.path, slots=slots, solo_rows=True, draft="ngram", cpu_kernels="mlx"
    ) as engine:
        runner = engine.debug.runner
        plain = await engine.debug.compute.run(runner.start, prompt, SamplingParams())
        want = []
        for _ in range(5):
            want.append(await engine.debug.compute.run(runner.next_logits, plain))
            plain.tokens.append(int(np.argmax(want[-1])))
        seq = await engine.debug.compute.run(runner.start, prompt, SamplingParams())
        draft = plain.tokens[len(prompt) : len(prompt) + 4]  # the right draft: all accepted

        def verify_logits():
            from smoe.compute.rowwise import RowSequence

            cache = [RowSequence(c) for c in seq.cache]
            with solo_rows(runner.rules):
                y = runner.model(mx.array([seq.tokens[-1], *draft])[None], cache=cache)
            return np.array(y[0].astype(mx.float32))

        got = await engine.debug.compute.run(verify_logits)
    for j in range(5):
        assert np.array_equal(got[j], want[j]), (j, np.abs(got[j] - want[j]).max())


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
async def test_greedy_with_drafts_equals_plain_under_the_rules(vaults):
    vault = vaults(2)
    ids = [3, 17, 40, 9, 22, 61, 5, 12] * 4

    async def run(**options) -> list[int]:
        async with Engine.open(
            vault.path, slots=6, solo_rows=True, **options, cpu_kernels="mlx"
        ) as engine:
            return [
                e.token
                async for e in engine.generate(ids, max_tokens=32, stop_at_eos=False)
                if e.token is not None
            ]

    assert await run(draft="ngram", draft_tokens=3) == await run()
