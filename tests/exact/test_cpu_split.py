"""A large expert call on the CPU is split over the cores' streams (smoe/compute/switch.py,
split_call) with every row's bits those of mlx-lm's one call: quantized and float experts,
sorted (64 pairs and more) and unsorted calls, shares of unequal size."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.switch_layers import SwitchGLU

import smoe.compute.switch as switch


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
    monkeypatch.setattr(switch, "cpu_streams", lambda: [mx.new_stream(mx.cpu) for _ in range(2)])
    got = switch.split_call(module, x, idx, sort=False)
    assert len(shares) == 2 and sum(shares) == tokens  # split, every row once
    assert got.shape == want.shape
    assert np.array_equal(np.array(got), np.array(want))
