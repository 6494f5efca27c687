"""S-MoE's CPU kernels (smoe._cpu_kernels, smoe.compute.native) give MLX's CPU bits.

Every instruction set this CPU runs is tried (AVX-512 where the CPU has it, AVX2, the
portable C), against MLX's own kernels in this process: ``mx.quantized_matmul`` (2 to 8
bits, groups 32/64/128, float32 and bfloat16), ``mx.gather_qmm`` and ``mx.gather_mm`` as
mlx-lm's expert layers call them (sorted and not, on ring-like strided banks), and
``mx.matmul``/``mx.addmm`` in float32; over random shapes and row counts (one row: the
fused kernel; a few: the n-lanes kernel; many: the m-lanes one) and every linear shape of
the synthesized architectures' presets. ``array_equal``, never allclose.
"""

from __future__ import annotations

import itertools
import os
import signal
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from smoe.compute import native
from smoe.compute.native import Native, NativeEmbedding, NativeLinear

ext = Native.here().ext
pytestmark = pytest.mark.skipif(ext is None, reason=str(Native.here().why_not))
ISAS = ext.available() if ext is not None else []


def same(a: mx.array, b: mx.array) -> bool:
    mx.eval(a, b)
    return bool(mx.array_equal(a, b, equal_nan=True).item())


def host(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def quantized_ref(x, wq, s, b, bits, group):
    return mx.quantized_matmul(
        x, wq, s, b, transpose=True, group_size=group, bits=bits, stream=mx.cpu
    )


def ours_quantized(x, wq, s, b, bits, group, isa):
    bf16 = x.dtype == mx.bfloat16
    out = np.empty((x.shape[0], wq.shape[0]), np.uint16 if bf16 else np.float32)
    ext.matmul(
        host(x),
        host(wq),
        out,
        scales=host(s),
        biases=host(b),
        bits=bits,
        group=group,
        bf16=bf16,
        isa=isa,
    )
    y = mx.array(out)
    return y.view(mx.bfloat16) if bf16 else y


def random_weights(rng, n, k, dtype, bits, group):
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32)).astype(dtype)
    return mx.quantize(w, group_size=group, bits=bits)


@pytest.mark.parametrize("isa", ISAS)
def test_quantized_matmul_bits_equal_mlx_over_random_shapes(isa):
    rng = np.random.default_rng(11)
    cases = 0
    for bits, group, dtype in itertools.product(
        (2, 3, 4, 5, 6, 8), (32, 64, 128), ("float32", "bfloat16")
    ):
        for _ in range(2):
            rows = int(rng.choice([1, 2, 3, 5, 6, 7, 9, 13, 16, 25, 64]))
            n = int(rng.choice([1, 7, 8, 16, 33, 64, 100, 130]))
            k = group * int(rng.choice([1, 2, 3, 5, 8]))
            d = getattr(mx, dtype)
            wq, s, b = random_weights(rng, n, k, d, bits, group)
            x = mx.array(rng.standard_normal((rows, k)).astype(np.float32)).astype(d)
            got = ours_quantized(x, wq, s, b, bits, group, isa)
            assert same(got, quantized_ref(x, wq, s, b, bits, group)), (
                bits,
                group,
                dtype,
                rows,
                n,
                k,
            )
            cases += 1
    assert cases == 72


@pytest.mark.parametrize("isa", ISAS)
def test_float_matmul_and_addmm_bits_equal_mlx(isa):
    rng = np.random.default_rng(12)
    for rows, n, k in [
        (1, 40, 300),
        (2, 33, 129),
        (5, 8, 64),
        (6, 70, 257),
        (9, 70, 64),
        (40, 17, 1000),
        (64, 130, 96),
        (3, 1, 5),
    ]:
        w = rng.standard_normal((n, k)).astype(np.float32)
        x = rng.standard_normal((rows, k)).astype(np.float32)
        bias = rng.standard_normal(n).astype(np.float32)
        for with_bias in (False, True):
            out = np.empty((rows, n), np.float32)
            ext.matmul(x, w, out, bias=bias if with_bias else None, isa=isa)
            xm, wm = mx.array(x), mx.array(w)
            ref = mx.addmm(mx.array(bias), xm, wm.T) if with_bias else xm @ wm.T
            assert same(mx.array(out), ref), (rows, n, k, with_bias)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["4-bit", "8-bit bfloat16", "float32"])
def test_gathered_experts_on_strided_banks_bits_equal_mlx(isa, kind):
    """gather_qmm / gather_mm over a bank whose slots are padded records (the unified
    ring's strided views), with mlx-lm's unsorted and sorted call shapes."""
    rng = np.random.default_rng(13)
    slots, n, k, top_k = 6, 48, 128, 2
    dtype = mx.bfloat16 if "bfloat16" in kind else mx.float32
    bits = 8 if "8-bit" in kind else 4
    if kind == "float32":
        dense = mx.array(rng.standard_normal((slots, n, k)).astype(np.float32))
        padded = mx.concatenate([dense, mx.zeros((slots, 3, k))], axis=1)  # slot padding
        w = padded[:, :n, :]  # a strided view, as a ring's
        comps = {"weight": w}
    else:
        stacked = mx.array(rng.standard_normal((slots, n, k)).astype(np.float32)).astype(dtype)
        wq, s, b = mx.quantize(stacked, group_size=64, bits=bits)
        comps = {"weight": wq, "scales": s, "biases": b}
    for tokens in (1, 5, 40):  # 40 x 2 = 80 rows: mlx-lm sorts from 64
        x = mx.array(rng.standard_normal((tokens, k)).astype(np.float32)).astype(dtype)
        idx = mx.array(
            np.stack([rng.choice(slots, top_k, replace=False) for _ in range(tokens)]),
            dtype=mx.uint32,
        )
        shapes = [(x[:, None, None, :], idx)]  # unsorted: [T, 1, 1, K] with [T, k]
        order = mx.argsort(idx.flatten())  # sorted: [P, 1, K] with [P]
        shapes.append((x[order // top_k][:, None, :], idx.flatten()[order]))
        for xs, ids in shapes:
            if kind == "float32":
                ref = mx.gather_mm(
                    xs, comps["weight"].swapaxes(-1, -2), rhs_indices=ids, stream=mx.cpu
                )
            else:
                ref = mx.gather_qmm(
                    xs,
                    comps["weight"],
                    comps["scales"],
                    comps["biases"],
                    rhs_indices=ids,
                    transpose=True,
                    group_size=64,
                    bits=bits,
                    stream=mx.cpu,
                )
            layer = nn.Module()
            for name, a in comps.items():
                layer[name] = a
            if kind != "float32":
                layer.bits, layer.group_size = bits, 64
            assert same(native.gather(ext, xs, layer, ids, isa), ref), (kind, tokens)


def preset_linear_shapes() -> set[tuple[int, int]]:
    """Every (outputs, inputs) of a linear layer or expert projection of the synthesized
    architectures' presets, as mlx-lm builds the models (no weights made)."""
    from transformers import AutoConfig

    from smoe.models.topology import model_classes, normalize_config
    from smoe.synth.presets import PRESETS, config_kwargs

    shapes = set()
    for preset in PRESETS.values():
        for arch in preset.archs:
            hf = AutoConfig.for_model(arch, **config_kwargs(arch, preset, 2)).to_dict()
            shapes |= _linear_shapes(normalize_config(hf), model_classes)
    return shapes


def _linear_shapes(config, model_classes) -> set[tuple[int, int]]:
    """The (outputs, inputs) of each 2-D or stacked weight of mlx-lm's model (lazy)."""
    from mlx.utils import tree_flatten

    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    return {
        (int(a.shape[-2]), int(a.shape[-1]))
        for name, a in tree_flatten(model.parameters())
        if name.endswith("weight") and a.ndim in (2, 3) and "norm" not in name
    }


def test_every_preset_shape_bits_equal_mlx():
    """Each architecture's and preset's linear shapes (Qwen3-30B-A3B's and 235B-A22B's
    experts and attention among them) at a decode row and at many rows, 4-bit and float32."""
    rng = np.random.default_rng(14)
    shapes = preset_linear_shapes()
    assert (768, 2048) in shapes and (1536, 4096) in shapes  # the two big presets' experts
    for n, k in sorted(shapes):
        if k % 64:
            continue  # not quantizable at group 64: float only below
        wq, s, b = random_weights(rng, n, k, mx.float32, 4, 64)
        for rows in (1, 9):
            x = mx.array(rng.standard_normal((rows, k)).astype(np.float32))
            assert same(
                ours_quantized(x, wq, s, b, 4, 64, ext.isa()), quantized_ref(x, wq, s, b, 4, 64)
            ), (n, k, rows)
    for n, k in sorted(shapes)[:: max(1, len(shapes) // 12)]:
        w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
        x = mx.array(rng.standard_normal((3, k)).astype(np.float32))
        assert same(native.linear(ext, x, w), x @ w.T), (n, k)


@pytest.fixture
def every_call(monkeypatch):
    """The kernels take calls of any size (the engine leaves small ones to MLX)."""
    monkeypatch.setattr(native, "MIN_MACS", 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_wrapped_layers_equal_the_layers(dtype, every_call):
    """NativeLinear, NativeEmbedding (a tied head) and mlx-lm's SwitchGLU (biases, as
    gpt_oss's) with NativeSwitchLinear projections give their inner layers' bits."""
    from mlx_lm.models.switch_layers import SwitchGLU

    d = getattr(mx, dtype)
    mx.random.seed(3)
    x = (mx.random.normal((2, 20, 128)) * 0.5).astype(d)
    lin = nn.Linear(128, 96, bias=True)
    qlin = nn.QuantizedLinear(128, 96, bias=True, group_size=64, bits=4)
    emb = nn.QuantizedEmbedding(200, 128, group_size=64, bits=4)
    for m in (lin, qlin, emb):
        m.set_dtype(d)
    if dtype == "float32":
        assert same(NativeLinear(lin)(x), lin(x))
    assert same(NativeLinear(qlin)(x), qlin(x))
    assert same(NativeEmbedding(emb).as_linear(x), emb.as_linear(x))
    assert same(NativeEmbedding(emb)(mx.array([[1, 5, 199]])), emb(mx.array([[1, 5, 199]])))
    glu = SwitchGLU(128, 64, 8, bias=True)
    nn.quantize(glu, group_size=64, bits=4)
    glu.set_dtype(d)
    wrapped = SwitchGLU(128, 64, 8, bias=True)
    nn.quantize(wrapped, group_size=64, bits=4)
    wrapped.update(glu.parameters())
    assert native.install_native(wrapped) == 3 and native.is_native(wrapped)
    for tokens in (1, 3, 20):  # 20 x 4 = 80 pairs: sorted
        idx = mx.array(
            np.random.default_rng(tokens).integers(0, 8, (1, tokens, 4)), dtype=mx.uint32
        )
        assert same(wrapped(x[:1, :tokens], idx), glu(x[:1, :tokens], idx)), tokens


def test_a_kind_whose_bits_differ_runs_mlx_and_says_so(monkeypatch, every_call):
    """Where the check against MLX fails for a kind of call (another MLX, another BLAS),
    the layer runs MLX's own kernel and the start line names the kind."""
    here = Native(ext, None)
    monkeypatch.setattr(Native, "here", staticmethod(lambda: here))
    monkeypatch.setattr(native, "_matches_mlx", lambda e, kind: kind[0] != "float32")
    lin = nn.Linear(64, 32)
    calls = []
    inner = lin.__call__
    monkeypatch.setattr(nn.Linear, "__call__", lambda self, x: calls.append(1) or inner(x))
    x = mx.ones((1, 64))
    assert same(NativeLinear(lin)(x), lin(x)) and calls
    assert "MLX's own for float32 matmul" in here.describe()


def test_small_calls_run_mlxs_kernel_and_large_ones_ours(monkeypatch):
    """A call under MIN_MACS multiply-adds stays MLX's (handing it over costs a graph
    evaluation its saving does not repay); a larger one is ours. The bits are MLX's both
    ways."""
    handed = []

    class Counting:  # the extension, its matmul calls counted
        def __getattr__(self, name):
            return getattr(ext, name)

        def matmul(self, *args, **kw):
            handed.append(args[0].shape)
            return ext.matmul(*args, **kw)

    here = Native(Counting(), None)
    monkeypatch.setattr(Native, "here", staticmethod(lambda: here))
    small, large = nn.Linear(256, 256, bias=False), nn.Linear(1024, 512, bias=False)
    x_small, x_large = mx.ones((1, 256)), mx.ones((1, 1024))
    assert 256 * 256 < native.MIN_MACS <= 1024 * 512
    NativeLinear(large)(x_large)  # the kind's first call: checked against MLX first
    handed.clear()
    assert same(NativeLinear(small)(x_small), small(x_small)) and not handed
    assert same(NativeLinear(large)(x_large), large(x_large)) and handed == [(1, 1024)]
    assert same(NativeLinear(small)(mx.ones((8, 256))), small(mx.ones((8, 256))))
    assert handed[-1] == (8, 256)  # 8 rows: 2^19 multiply-adds


def test_an_instruction_set_this_cpu_lacks_is_refused():
    x = np.zeros((1, 8), np.float32)
    with pytest.raises(ValueError, match="not available"):
        ext.matmul(x, np.zeros((4, 8), np.float32), np.empty((1, 4), np.float32), isa="sse9")
    assert set(ISAS) <= {"avx512", "avx2", "scalar"} and "scalar" in ISAS


def test_bad_arguments_are_errors_not_crashes():
    x = np.zeros((2, 64), np.float32)
    w = np.zeros((4, 64 * 4 // 32), np.uint32)
    sb = np.zeros((4, 1), np.float32)
    out = np.empty((2, 4), np.float32)
    with pytest.raises(ValueError):  # packed width does not match K at 8 bits
        ext.matmul(x, w, out, scales=sb, biases=sb, bits=8, group=64)
    with pytest.raises(IndexError):  # an expert past the stack
        ext.matmul(
            x,
            w,
            out,
            scales=sb,
            biases=sb,
            bits=4,
            group=64,
            rows=np.array([0, 1], np.int32),
            experts=np.array([0, 3], np.int32),
        )
    with pytest.raises(ValueError):  # out of the wrong shape
        ext.matmul(x, w, np.empty((3, 4), np.float32), scales=sb, biases=sb, bits=4, group=64)


def test_a_forked_child_computes_with_a_pool_of_its_own():
    """A worker pool's threads do not survive fork: the child must start its own, not wait
    forever on the parent's (a server's workers, multiprocessing's fork start)."""
    rng = np.random.default_rng(14)
    x = rng.standard_normal((64, 1024)).astype(np.float32)
    w = rng.standard_normal((512, 1024)).astype(np.float32)
    ext.set_threads(2)  # a call this large goes to the pool, whose worker now exists
    want = np.empty((64, 512), np.float32)
    ext.matmul(x, w, want)
    pid = os.fork()
    if pid == 0:  # the child: one call, its verdict as the exit status
        got = np.empty_like(want)
        ext.matmul(x, w, got)
        os._exit(0 if np.array_equal(got.view(np.uint32), want.view(np.uint32)) else 3)
    for _ in range(6000):  # bounds a hang (on the parent's pool), not the time taken
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the forked child hung in the kernels' pool")
    ext.set_threads(0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
