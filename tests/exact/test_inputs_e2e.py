"""Every kind of checkpoint `smoe convert` accepts runs, and generates what mlx-lm generates.

For each input kind a tiny checkpoint is converted, opened by the engine, and its greedy
tokens (and teacher-forced logits, bit for bit) are compared with mlx-lm's own loader and
``generate_step`` on the very same source checkpoint, computing in the same dtype:

- float32 (the CPU default): mlx-lm's model after ``model.set_dtype(mx.float32)``;
- bfloat16 (``dtype="bfloat16"``): mlx-lm's model exactly as loaded, the usual bf16 run.

Input kinds: Hugging Face bf16 and fp32 (transformers' save_pretrained), mlx-lm quantized
(``mlx_lm.convert -q``, mlx-community style: no per-path entries in its config), and
mixed bits (mlx-lm's ``mixed_3_6`` recipe, and a custom predicate).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from smoe.engine import Engine
from smoe.errors import SmoeError
from smoe.vault.convert import ConvertOptions, convert
from tests.conftest import make_hf_checkpoint

PROMPT = np.random.default_rng(7).integers(2, 256, 10).tolist()  # one prefill chunk
STEPS = 8


def add_tokenizer(path: Path) -> None:
    """A word-level tokenizer over the 256 ids ("t0".."t255"): mlx_lm.load and
    mlx_lm.convert need one, and these random checkpoints come without."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t0", "eos_token": "t1"}
        )
    )


def mixed_predicate(path: str, module: nn.Module) -> bool | dict:
    """Experts 4-bit (down_proj 8-bit, group 32), attention 8-bit, router float, the rest
    (embeddings, LM head) 6-bit: a per-path entry for every module in config.json."""
    if path.endswith("switch_mlp.down_proj"):
        return {"group_size": 32, "bits": 8, "mode": "affine"}
    if "switch_mlp" in path:
        return {"group_size": 64, "bits": 4, "mode": "affine"}
    if "self_attn" in path:
        return {"group_size": 64, "bits": 8, "mode": "affine"}
    if path.endswith(".gate"):
        return False
    return {"group_size": 64, "bits": 6, "mode": "affine"}


def not_experts(path: str, module: nn.Module) -> bool:
    """Everything 4-bit but the experts, which stay bf16: config.json says "4-bit" at the
    top and names no module, so only the missing .scales tell that the experts are float."""
    return "switch_mlp" not in path


@pytest.fixture(scope="module")
def sources(hf_dir, tmp_path_factory):
    """Factory: the source checkpoint of each input kind, made once (mixtral, 2 layers)."""
    root = tmp_path_factory.mktemp("inputs")
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind in made:
            return made[kind]
        out = root / kind
        if kind == "hf-bf16":
            shutil.copytree(hf_dir("mixtral"), out)
            add_tokenizer(out)
        elif kind == "hf-fp32":
            import torch
            import transformers

            model = transformers.AutoModelForCausalLM.from_pretrained(
                get("hf-bf16"), dtype=torch.float32
            )
            model.save_pretrained(out)
            add_tokenizer(out)
        elif kind == "mixtral-1-layer":  # mixed_3_6 packs its one MoE layer's experts alike
            make_hf_checkpoint(out, "mixtral", num_hidden_layers=1)
            add_tokenizer(out)
        else:
            from mlx_lm import convert as mlx_lm_convert

            hf, kwargs = {
                "mlx-q4": ("hf-bf16", dict(q_bits=4, q_group_size=64)),
                "mlx-mxfp4": ("hf-bf16", dict(q_mode="mxfp4", q_group_size=32)),
                "mlx-float-experts": ("hf-bf16", dict(quant_predicate=not_experts)),
                "mlx-mixed-custom": ("hf-bf16", dict(quant_predicate=mixed_predicate)),
                "mlx-mixed_3_6": ("mixtral-1-layer", dict(quant_predicate="mixed_3_6")),
                "mlx-mixed_3_6-2-layers": ("hf-bf16", dict(quant_predicate="mixed_3_6")),
            }[kind]
            kwargs.setdefault("q_group_size", 64)
            mlx_lm_convert(str(get(hf)), str(out), quantize=True, **kwargs)
        made[kind] = out
        return out

    return get


def mlx_lm_model(src: Path, dtype: mx.Dtype, quantize_experts: bool = False) -> nn.Module:
    """mlx-lm's own model for ``src`` (mlx_lm.load), computing in ``dtype`` (module doc).
    ``quantize_experts``: mlx-lm's 4-bit group-64 quantization of the experts only, which
    is what `smoe convert` does to a float checkpoint by default."""
    from mlx_lm import load
    from mlx_lm.models.switch_layers import SwitchLinear

    model, _ = load(str(src))
    if quantize_experts:
        nn.quantize(model, 64, 4, class_predicate=lambda _, m: isinstance(m, SwitchLinear))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def mlx_lm_run(model: nn.Module) -> tuple[list[int], np.ndarray]:
    """mlx-lm's greedy generation (generate_step) and its teacher-forced prompt logits."""
    from mlx_lm.generate import generate_step

    tokens = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=STEPS)]
    logits = model(mx.array(PROMPT)[None])[0].astype(mx.float32)
    return tokens, np.array(logits)


def engine_run(vault_path: Path, dtype: str | None = None) -> tuple[list[int], np.ndarray, str]:
    """Engine.generate's greedy tokens, the prompt's logits, the compute dtype reported."""

    async def run() -> tuple[list[int], np.ndarray, str]:
        async with Engine.open(vault_path, dtype=dtype) as engine:
            tokens, reported = [], ""
            events = engine.generate(PROMPT, max_tokens=STEPS, temperature=0.0, stop_at_eos=False)
            async for ev in events:
                if ev.token is not None:
                    tokens.append(ev.token)
                if ev.stats is not None:
                    reported = ev.stats.compute_dtype
            return tokens, await engine.logits(PROMPT), reported

    return asyncio.run(run())


# kind -> (convert options, mlx-lm quantizes the experts as smoe does, dtypes to compute in)
CASES = {
    "hf-bf16": (ConvertOptions(), True, ("float32", "bfloat16")),
    "hf-fp32": (ConvertOptions(), True, ("float32",)),
    "mlx-q4": (ConvertOptions(), False, ("float32", "bfloat16")),
    "mlx-mxfp4": (ConvertOptions(), False, ("float32", "bfloat16")),
    # bf16 float experts: MLX's CPU gather_mm is float32 only (mlx-lm cannot run them either)
    "mlx-float-experts": (ConvertOptions(), False, ("float32",)),
    "mlx-mixed-custom": (ConvertOptions(), False, ("float32", "bfloat16")),
    "mlx-mixed_3_6": (ConvertOptions(), False, ("float32",)),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_input_kind_converts_runs_and_equals_mlx_lm(kind, sources, tmp_path):
    opts, quantize_experts, dtypes = CASES[kind]
    src = sources(kind)
    vault = convert(src, tmp_path / "v", opts)
    for dtype in dtypes:
        want_tokens, want_logits = mlx_lm_run(
            mlx_lm_model(src, getattr(mx, dtype), quantize_experts)
        )
        tokens, logits, reported = engine_run(vault.path, None if dtype == "float32" else dtype)
        assert reported == dtype
        assert tokens == want_tokens, dtype
        assert np.array_equal(logits, want_logits), (dtype, np.abs(logits - want_logits).max())


def test_mlx_lm_quantized_vault_says_what_it_copied(sources, tmp_path):
    """The vault's summary names the source's packing (per projection when mixed), and its
    config keeps mlx-lm's per-path entries."""
    uniform = convert(sources("mlx-q4"), tmp_path / "u").manifest.quantization
    assert uniform["experts"] == {
        "mode": "affine",
        "bits": 4,
        "group_size": 64,
        "copied_from_source": True,
    }
    assert uniform["backbone"] == {
        "group_size": 64,
        "bits": 4,
        "mode": "affine",
        "copied_from_source": True,
    }
    mixed = convert(sources("mlx-mixed-custom"), tmp_path / "m")
    experts = mixed.manifest.quantization["experts"]
    assert (experts["bits"], experts["group_size"]) == ("4/8", "32/64")
    assert experts["projections"]["down_proj"] == {"mode": "affine", "bits": 8, "group_size": 32}
    assert mixed.config()["quantization"]["model.layers.0.self_attn.q_proj"]["bits"] == 8
    recipe = convert(sources("mlx-mixed_3_6"), tmp_path / "r").manifest.quantization
    assert recipe["experts"]["bits"] == "3/6"  # down_proj 6-bit, gate/up 3-bit
    # each expert projection's packing is named in config.json, as mlx-lm loaded it
    moe = "model.layers.1.block_sparse_moe.switch_mlp"
    config = convert(sources("mlx-float-experts"), tmp_path / "f").config()["quantization"]
    assert (config["bits"], config[f"{moe}.up_proj"]) == (4, False)
    assert uniform_config(tmp_path / "u")[f"{moe}.up_proj"] == {
        "group_size": 64,
        "bits": 4,
        "mode": "affine",
    }


def uniform_config(vault: Path) -> dict:
    return json.loads((vault / "config.json").read_text())["quantization"]


def test_float_experts_in_bf16_on_the_cpu_are_refused_naming_the_fix(sources, tmp_path):
    """MLX's CPU gather_mm multiplies float experts in float32 only: asking for bf16 is a
    SmoeError naming --dtype float32, not a RuntimeError in the middle of a generation."""
    vault = convert(sources("mlx-float-experts"), tmp_path / "v")
    with pytest.raises(SmoeError, match="--dtype float32"):
        engine_run(vault.path, "bfloat16")


def test_experts_packed_differently_per_layer_are_refused_naming_the_fix(sources, tmp_path):
    """mixed_3_6 on two layers gives layer 1's down_proj 6 bits and layer 0's 3: records of
    one vault share one layout, so this is refused before anything is written."""
    with pytest.raises(SmoeError, match="differently from layer to layer") as e:
        convert(sources("mlx-mixed_3_6-2-layers"), tmp_path / "v")
    assert "3 bits" in str(e.value) and "6 bits" in str(e.value) and "--bits" in str(e.value)
    assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_mlx_source_honours_dtype(sources, tmp_path):
    """--dtype float32 on an MLX source casts its float tensors (scales included, exactly:
    bf16 -> f32 is lossless); the packed weights are copied as they are."""
    from smoe.vault.export import read_layer

    src = sources("mlx-q4")
    a = convert(src, tmp_path / "a")
    b = convert(src, tmp_path / "b", ConvertOptions(dtype="float32"))
    assert {c.dtype for c in b.manifest.record.components} == {"uint32", "float32"}
    for spec in a.manifest.layers:
        la, lb = read_layer(a, spec.layer), read_layer(b, spec.layer)
        for name in la:
            assert mx.array_equal(la[name].astype(lb[name].dtype), lb[name]), name
    assert b.manifest.quantization["float_dtype"] == "float32"


def test_cpu_default_dtype_is_reported_and_differs_from_a_bf16_run(sources, tmp_path, run_cli):
    """A bf16 model on the CPU computes in float32 by default: not mlx-lm's usual bf16
    run, so generate says so (text and --json), naming the --dtype that matches it."""
    vault = convert(sources("mlx-q4"), tmp_path / "v")
    _, logits, reported = engine_run(vault.path)
    _, bf16_logits = mlx_lm_run(mlx_lm_model(sources("mlx-q4"), mx.bfloat16))
    assert reported == "float32" and not np.array_equal(logits, bf16_logits)

    code, out, _ = run_cli(
        "generate", vault.path, "--prompt-ids", "3,4,5", "--max-tokens", "2", "--json"
    )
    stats = json.loads(out)["stats"]
    assert code == 0 and stats["compute_dtype"] == "float32"
    assert stats["compute_dtype_note"] == (
        "float32 (the CPU's fast dtype; the weights are bfloat16: --dtype bfloat16 computes "
        "as mlx-lm runs them)"
    )
    code, _, err = run_cli(
        "generate", vault.path, "--prompt-ids", "3,4,5", "--max-tokens", "2", "--dtype", "bfloat16"
    )
    assert code == 0
    assert "computed in bfloat16 (the weights' dtype, as mlx-lm runs them)" in err
