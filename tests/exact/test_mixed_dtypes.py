"""Each tensor computes in the dtype mlx-lm's loaded model holds it in.

Real checkpoints keep some tensors wider than the rest on purpose: DeepSeek's routers and
``e_score_correction_bias`` in float32 beside bfloat16 weights (transformers 5.25 writes
them so, as the published DeepSeek-V3 checkpoints do). mlx-lm's ``load_model`` casts
nothing, so its matmul of a bfloat16 row by a float32 router runs in float32. Here every
architecture gets such a checkpoint (each router's weight, bias and correction bias in
float32 at full precision, the rest bfloat16), and the engine at ``--dtype bfloat16``
must give mlx-lm's bits on the export at every ring, and its start line must say which
tensors kept their dtype (smoe.models.dtypes).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from smoe.compute.model import float_policy, resident_model
from smoe.engine import Engine
from smoe.models.checkpoint import safetensors_header
from smoe.models.dtypes import FloatPolicy, describe_exceptions, weights_dtype
from smoe.plan.budget import backbone_bytes
from smoe.vault.convert import convert
from smoe.vault.export import export_mlx
from smoe.vault.format import Vault
from tests.exact.test_engine_exact import (
    ARCHS,
    engine_decode,
    engine_generate,
    reference_decode,
    reference_logits,
)

STEPS = 8
ROUTER_ENDINGS = (".gate.weight", ".router.weight", ".router.bias", "e_score_correction_bias")


def widen_routers(folder: Path, seed: int = 0) -> list[str]:
    """Rewrite ``folder``'s checkpoint with each router tensor in float32, perturbed off
    the bfloat16 grid (so casting it back to bfloat16 changes it); the rest as it was.
    Returns the names widened."""
    import torch
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    widened = []
    for shard in sorted(folder.glob("*.safetensors")):
        tensors = load_file(shard)
        for name, t in tensors.items():
            if name.endswith(ROUTER_ENDINGS):
                wide = t.float()
                noise = torch.rand(wide.shape, generator=gen) * 0.02 - 0.01
                if name.endswith("e_score_correction_bias"):  # zeros at init: make it matter
                    wide = torch.randn(wide.shape, generator=gen) * 0.05
                tensors[name] = wide * (1 + noise)
                widened.append(name)
        save_file(tensors, shard, metadata={"format": "pt"})
    return widened


@pytest.fixture(scope="module")
def mixed(hf_dir, tmp_path_factory):
    """Factory: (4-bit vault with bfloat16 scales and float32 routers, mlx-lm's model of
    its export as loaded) per arch."""
    from mlx_lm.utils import load_model

    cache: dict[str, tuple[Vault, object]] = {}

    def get(arch: str) -> tuple[Vault, object]:
        if arch not in cache:
            root = tmp_path_factory.mktemp(f"mixed-{arch}")
            src = root / "hf"
            shutil.copytree(hf_dir(arch), src)
            assert widen_routers(src), f"{arch}: no router tensor found"
            vault = convert(src, root / "v")
            model, _ = load_model(export_mlx(vault, root / "mlx"))
            model.eval()
            cache[arch] = (vault, model)
        return cache[arch]

    return get


def _prompt(n: int) -> list[int]:
    return np.random.default_rng(5).integers(2, 256, n).tolist()


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
@pytest.mark.parametrize("arch", ARCHS)
async def test_float32_routers_stay_float32_as_mlx_lm_keeps_them(arch, mixed):
    """At --dtype bfloat16 (the GPU's default, run here on the CPU) the engine equals
    mlx-lm's loaded model bit for bit: teacher-forced logits, decode logits and greedy
    tokens, at the smallest ring (waves) and with every expert resident."""
    vault, ref = mixed(arch)
    wide = [n for n, a in tree_flatten(ref.parameters()) if a.dtype == mx.float32]
    assert wide and all(n.endswith(ROUTER_ENDINGS) for n in wide), wide  # the premise
    prompt = _prompt(70)
    want = reference_logits(ref, prompt)
    ref_tokens, ref_step_logits = reference_decode(ref, prompt, STEPS)
    top_k = vault.manifest.shape.experts_per_token
    for slots in (top_k, vault.manifest.num_records):
        async with Engine.open(vault.path, slots=slots, dtype="bfloat16", device="cpu") as engine:
            assert "float32 as stored" in engine.stats().compute_dtype_note
            got = await engine.logits(prompt)
            assert np.array_equal(got, want), (arch, slots)
            step_logits, picks = await engine_decode(engine, prompt, ref_tokens)
            for i, (a, b) in enumerate(zip(step_logits, ref_step_logits, strict=True)):
                assert np.array_equal(a, b), (arch, slots, i)
            assert picks == ref_tokens
            assert await engine_generate(engine, prompt, STEPS) == ref_tokens, (arch, slots)


def test_the_compute_line_names_the_tensors_kept_wide(mixed):
    """The start line's compute dtype says per part what runs: bfloat16 for the weights,
    the routers float32 as stored; at float32 nothing is kept apart."""
    from smoe.compute.model import compute_dtype_note

    vault, _ = mixed("deepseek_v3")
    note = compute_dtype_note(vault, mx.bfloat16, requested=True)
    assert note == (
        "bfloat16 (the weights' dtype, as mlx-lm runs them; "
        "mlp.gate.weight, mlp.gate.e_score_correction_bias float32 as stored)"
    )
    assert compute_dtype_note(vault, mx.float32, requested=False) == (
        "float32 (the CPU's fast dtype; the weights are bfloat16: "
        "--dtype bfloat16 computes as mlx-lm runs them)"
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_budget_counts_the_routers_at_their_kept_width(mixed, dtype):
    """The header-only backbone count equals the loaded backbone's nbytes with float32
    routers beside bfloat16 weights, at either compute dtype."""
    vault, _ = mixed("deepseek_v3")
    model = resident_model(vault, getattr(mx, dtype))
    prefixes = tuple(spec.module + "." for spec in vault.manifest.layers)
    params = [(n, a) for n, a in tree_flatten(model.parameters()) if not n.startswith(prefixes)]
    loaded = sum(a.nbytes for _, a in params)
    policy = float_policy(vault, getattr(mx, dtype))
    assert backbone_bytes(safetensors_header(vault.backbone_path), policy) == loaded
    routers = [a.dtype for n, a in params if n.endswith(ROUTER_ENDINGS)]
    assert routers and set(routers) == {mx.float32}


def test_the_float_policy():
    """The rule on its own: the weights' dtype follows the compute dtype unless mlx-lm's
    cast_predicate exempts the tensor; any other float keeps the wider of the two."""
    never = "e_score_correction_bias"
    policy = FloatPolicy("bfloat16", "bfloat16", lambda name: never not in name)
    assert policy.kept("w", "bfloat16") == "bfloat16"
    assert policy.kept("gate.weight", "float32") == "float32"
    assert policy.kept("norm", "float16") == "float16"  # as wide: as stored
    assert policy.kept("w", "uint32") == "uint32"
    f32 = FloatPolicy("float32", "bfloat16")
    assert {f32.kept("w", d) for d in ("bfloat16", "float16", "float32")} == {"float32"}
    # A float32 checkpoint run at bfloat16, as `mlx_lm.convert --dtype bfloat16` casts it
    down = FloatPolicy("bfloat16", "float32", lambda name: never not in name)
    assert down.kept("w", "float32") == "bfloat16"
    assert down.kept(f"a.{never}", "float32") == "float32"
    assert down.exceptions({"w": "float32", f"model.layers.3.{never}": "float32"}) == {
        f"model.layers.3.{never}": "float32"
    }
    assert describe_exceptions(
        {"model.layers.1.a.b": "float32", "model.layers.2.a.b": "float32"}
    ) == ("a.b float32")
    # The experts' dtype decides; else most of the backbone's float elements
    assert weights_dtype(["uint32", "bfloat16"], {"r": ("float32", 10**9)}) == "bfloat16"
    assert weights_dtype([], {"a": ("float32", 10), "b": ("bfloat16", 11)}) == "bfloat16"
    assert weights_dtype([], {"a": ("uint32", 10)}) is None
