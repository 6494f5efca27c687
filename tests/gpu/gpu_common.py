"""What the GPU tests share: the engine settings a CUDA GPU gets, the reports, the models
(a vault and mlx-lm's model of its export, as mlx-lm loads it) and the reference decode.

SMOE_GPU_TESTS_ON_CPU=1 runs the GPU tests on the CPU (bfloat16, staged ring, CUDA's
kernel rules forced): a dry run of their code, not of CUDA's arithmetic.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from smoe.chat.demo import DEMO_SOURCE
from smoe.engine import Engine
from smoe.synth import synthesize
from smoe.vault.convert import ConvertOptions, convert
from smoe.vault.export import export_mlx
from tests.exact.test_engine_exact import greedy

CUDA = mx.is_available(mx.gpu) and not mx.metal.is_available()
RUN = CUDA or os.environ.get("SMOE_GPU_TESTS_ON_CPU") == "1"
GPU_MARKS = [pytest.mark.gpu, pytest.mark.skipif(not RUN, reason="needs a CUDA GPU")]
ENGINE: dict = {"ring": "staged", "dtype": "bfloat16"}  # what a CUDA GPU gets by default
if not CUDA:  # the CPU dry run: CUDA's kernel rules forced, to run their code
    ENGINE["solo_rows"] = True

CHUNK = 64
STEPS = 64
SYNTH_ARCHS = [
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
]


def report(entry: dict) -> None:
    """Append ``entry`` as a JSON line to SMOE_GPU_REPORT, if set."""
    path = os.environ.get("SMOE_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def source_of(arch: str, root: Path) -> Path:
    """The checkpoint of a GPU test model: the trained demo ('kjv_demo'), Qwen3-30B-A3B's
    geometry in 4 layers ('qwen3_30b'), or a synthesized demo preset of ``arch``."""
    if arch == "kjv_demo":
        return DEMO_SOURCE
    if arch == "qwen3_30b":
        return synthesize(root / "hf", arch="qwen3_moe", preset="qwen3-30b-a3b", layers=4, seed=1)
    return synthesize(root / "hf", arch=arch, preset="demo", seed=1)


def load_models(root_factory):
    """Factory: (vault, mlx-lm's model of its export) per (arch, bits), mlx-lm's model as
    its ``load_model`` gives it: every tensor in its stored dtype (bfloat16, a float32
    router where the checkpoint keeps one), which the engine at bfloat16 must equal.
    ``root_factory(name)`` gives a new folder."""
    from mlx_lm.utils import load_model

    cache: dict = {}

    def get(arch: str, bits: int):
        if (arch, bits) not in cache:
            root = root_factory(f"gpu-{arch}-{bits}")
            vault = convert(source_of(arch, root), root / "v", ConvertOptions(bits=bits))
            model, _ = load_model(export_mlx(vault, root / "mlx"))
            model.eval()
            cache[arch, bits] = (vault, model)
        return cache[arch, bits]

    return get


def reference(model, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """mlx-lm in memory with the engine's schedule: prompt[:-1] in chunks, then one token
    at a time, greedy. Returns the tokens and each step's logits (float32)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    head = prompt[:-1]
    for start in range(0, len(head), CHUNK):
        model(mx.array(head[start : start + CHUNK])[None], cache=cache)
        mx.eval([c.state for c in cache])
    tokens, logits = list(prompt), []
    for _ in range(steps):
        y = model(mx.array(tokens[-1:])[None], cache=cache)[0, -1]
        mx.eval(y)
        logits.append(np.array(y.astype(mx.float32)))
        tokens.append(greedy(y))
    return tokens[len(prompt) :], logits


async def generate(engine: Engine, prompt: list[int], n: int, after=None) -> list[int]:
    """``n`` greedy tokens of ``prompt`` (EOS ignored). ``after(i)``, if given, is awaited
    once the i-th token has arrived, before the next is asked for (a forced switch)."""
    out = []
    async for ev in engine.generate(prompt, max_tokens=n, temperature=0.0, stop_at_eos=False):
        if ev.token is not None:
            out.append(ev.token)
            if after is not None:
                await after(len(out))
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
