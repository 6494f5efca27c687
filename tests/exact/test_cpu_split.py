"""Large CPU calls are split over the cores' streams with every row's bits those of
mlx-lm's one call: expert calls (smoe/compute/switch.py, split_call: quantized and float
experts, sorted (64 pairs and more) and unsorted calls, shares of unequal size) and the
backbone's quantized linear layers (smoe/compute/cpu_split.py), at a real model's shapes."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.switch_layers import SwitchGLU

import smoe.compute.switch as switch
from smoe.compute import cpu_split
from smoe.util import blas


@pytest.mark.parametrize("quantized", [True, False], ids=["4-bit", "float"])
@pytest.mark.parametrize("tokens", [32, 33, 70])
def test_a_split_call_has_the_bits_of_the_whole_call(quantized, tokens, monkeypatch):
    mx.set_default_device(mx.cpu)
    mx.random.seed(3)
    module = SwitchGLU(128, 64, 16)
    if quantized:
        nn.quantize(module, group_size=64, bits=4)
    mx.eval(module.parameters())
    rng = np.random.default_rng(tokens)
    x = mx.array(rng.standard_normal((1, tokens, 128)).astype(np.float32))
    idx = mx.array(np.stack([rng.choice(16, 4, replace=False) for _ in range(tokens)])[None])
    want = module(x, idx)  # mlx-lm's own call: [1, T, 4, 128]
    shares = []
    inner = switch.switch_call
    monkeypatch.setattr(
        switch, "switch_call", lambda m, a, i, s: shares.append(i.shape[0]) or inner(m, a, i, s)
    )
    monkeypatch.setattr(cpu_split, "cpu_streams", lambda: [mx.new_stream(mx.cpu) for _ in range(2)])
    got = switch.split_call(module, x, idx, sort=False)
    assert len(shares) == 2 and sum(shares) == tokens  # split, every row once
    assert got.shape == want.shape
    assert np.array_equal(np.array(got), np.array(want))


@pytest.mark.parametrize("bits", [4, None], ids=["4-bit", "float"])
@pytest.mark.parametrize("tokens", [32, 64, 119])
def test_a_split_linear_has_the_bits_of_the_whole_call(tokens, bits, monkeypatch):
    """Qwen3-30B-A3B's q_proj shape (2048 -> 4096), as a prefill chunk runs it: 4-bit
    (MLX's kernel), and float under MLX's bundled BLAS (the engine splits it only there)."""
    if bits is None and blas.in_use() != blas.BUNDLED:
        pytest.skip("float linears are split only under MLX's bundled BLAS")
    mx.set_default_device(mx.cpu)
    mx.random.seed(tokens)
    lin = nn.Linear(2048, 4096, bias=False)
    if bits is not None:
        lin = nn.QuantizedLinear.from_linear(lin, 64, bits)
    mx.eval(lin.parameters())
    x = mx.random.normal((1, tokens, 2048))
    want = lin(x)  # mlx-lm's call: [1, T, 4096]
    rows = []
    monkeypatch.setattr(cpu_split, "cpu_streams", lambda: [mx.new_stream(mx.cpu) for _ in range(2)])
    split = cpu_split.RowSplitLinear(lambda a: rows.append(a.shape[0]) or lin(a))
    got = split(x)
    assert len(rows) == 2 and sum(rows) == tokens
    assert np.array_equal(np.array(got), np.array(want))


def tiny_qwen3_moe(quantized: bool):
    from mlx_lm.models import qwen3_moe

    args = qwen3_moe.ModelArgs(
        model_type="qwen3_moe",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        rms_norm_eps=1e-6,
        vocab_size=256,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=1e6,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        norm_topk_prob=True,
    )
    mx.random.seed(0)
    model = qwen3_moe.Model(args)
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("quantized", [True, False], ids=["4-bit", "float"])
def test_install_row_split_wraps_the_linears_it_is_not_told_to_skip(quantized, monkeypatch):
    """Quantized linears always; float ones only when asked (under MLX's bundled BLAS).
    The routers are skipped; the model's output keeps its bits."""
    if not quantized and blas.in_use() != blas.BUNDLED:
        pytest.skip("float linears are split only under MLX's bundled BLAS")
    mx.set_default_device(mx.cpu)
    model = tiny_qwen3_moe(quantized)
    tokens = mx.array(np.random.default_rng(0).integers(0, 256, (1, 40)))
    want = model(tokens)
    skip_routers = lambda path, parent: path.endswith("mlp.gate")  # noqa: E731
    if not quantized:
        assert cpu_split.install_row_split(model, skip_routers, floats=False) == 0
    n = cpu_split.install_row_split(model, skip_routers, floats=True)
    # 4 attention projections a layer and the LM head; the routers were skipped
    assert n == 2 * 4 + 1
    assert not any(
        isinstance(m, cpu_split.RowSplitLinear)
        for p, m in model.named_modules()
        if p.endswith("mlp.gate")
    )
    monkeypatch.setattr(cpu_split, "cpu_streams", lambda: [mx.new_stream(mx.cpu) for _ in range(2)])
    assert np.array_equal(np.array(model(tokens)), np.array(want))
