"""On a CUDA GPU: float32 routers beside bfloat16 weights compute as mlx-lm's loaded model
computes them (tests/exact/test_mixed_dtypes.py's cells, on the GPU's kernels and at its
default dtype), for every architecture at 4 and 16 bits, at the smallest ring and with
every expert resident."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from smoe.engine import Engine
from smoe.vault.convert import ConvertOptions, convert
from smoe.vault.export import export_mlx
from tests.exact.test_engine_exact import engine_decode
from tests.exact.test_mixed_dtypes import widen_routers
from tests.gpu.gpu_common import CUDA, ENGINE, GPU_MARKS, SYNTH_ARCHS, generate, reference, report

pytestmark = GPU_MARKS
STEPS = 16


@pytest.mark.asyncio(loop_factories=["uvloop"])  # the loop smoe runs on; GPU time is scarce
@pytest.mark.parametrize("bits", [4, 16])
@pytest.mark.parametrize("arch", SYNTH_ARCHS)
async def test_float32_routers_on_the_gpu(arch, bits, hf_dir, tmp_path):
    from mlx_lm.utils import load_model

    if bits == 16 and not CUDA:
        pytest.skip("MLX's CPU gather_mm computes float32 only")
    src = tmp_path / "hf"
    shutil.copytree(hf_dir(arch), src)
    widen_routers(src)
    vault = convert(src, tmp_path / "v", ConvertOptions(bits=bits))
    model, _ = load_model(export_mlx(vault, tmp_path / "mlx"))
    model.eval()
    prompt = np.random.default_rng(3).integers(2, 256, 70).tolist()
    want, want_logits = reference(model, prompt, STEPS)
    m = vault.manifest
    wrong = []
    for slots in (m.shape.experts_per_token, m.num_records):
        async with Engine.open(vault.path, slots=slots, **ENGINE) as engine:
            note = engine.stats().compute_dtype_note
            tokens = await generate(engine, prompt, STEPS)
            logits, _ = await engine_decode(engine, prompt, want)
        same = sum(np.array_equal(a, b) for a, b in zip(logits, want_logits, strict=True))
        report(
            {
                "test": "float32 routers",
                "arch": arch,
                "bits": bits,
                "slots": slots,
                "tokens_equal": tokens == want,
                "steps_bit_identical": f"{same}/{STEPS}",
                "compute": note,
            }
        )
        if tokens != want or same != STEPS or "float32 as stored" not in note:
            wrong.append((slots, same, note))
    assert not wrong, wrong
