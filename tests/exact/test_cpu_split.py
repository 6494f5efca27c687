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


@pytest.mark.parametrize("tokens", [32, 64, 119])
def test_a_split_linear_has_the_bits_of_the_whole_call(tokens, monkeypatch):
    """Qwen3-30B-A3B's q_proj shape (2048 -> 4096), 4-bit, as a prefill chunk runs it."""
    mx.set_default_device(mx.cpu)
    mx.random.seed(tokens)
    lin = nn.QuantizedLinear.from_linear(nn.Linear(2048, 4096, bias=False), 64, 4)
    mx.eval(lin.parameters())
    x = mx.random.normal((1, tokens, 2048))
    want = lin(x)  # mlx-lm's call: [1, T, 4096]
    rows = []
    monkeypatch.setattr(cpu_split, "cpu_streams", lambda: [mx.new_stream(mx.cpu) for _ in range(2)])
    split = cpu_split.RowSplitLinear(lambda a: rows.append(a.shape[0]) or lin(a))
    got = split(x)
    assert len(rows) == 2 and sum(rows) == tokens
    assert np.array_equal(np.array(got), np.array(want))


def test_install_row_split_wraps_the_quantized_linears_it_is_not_told_to_skip(monkeypatch):
    from mlx_lm.models import qwen3_moe

    mx.set_default_device(mx.cpu)
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
    model = qwen3_moe.Model(args)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    tokens = mx.array(np.random.default_rng(0).integers(0, 256, (1, 40)))
    want = model(tokens)
    n = cpu_split.install_row_split(model, lambda path, parent: path.endswith("mlp.gate"))
    # 4 attention projections a layer and the LM head; the routers were skipped
    assert n == 2 * 4 + 1
    assert not any(
        isinstance(m, cpu_split.RowSplitLinear)
        for p, m in model.named_modules()
        if p.endswith("mlp.gate")
    )
    monkeypatch.setattr(cpu_split, "cpu_streams", lambda: [mx.new_stream(mx.cpu) for _ in range(2)])
    assert np.array_equal(np.array(model(tokens)), np.array(want))
