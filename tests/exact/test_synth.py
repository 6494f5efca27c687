"""`smoe synth`: layout equal to transformers' own save_pretrained, determinism, decisiveness,
tokenizer, loadability by transformers and mlx-lm, atomic output."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from smoe.errors import SmoeError
from smoe.synth import ARCHS, PRESETS, layout, synthesize, weights
from smoe.synth.tokenizer import SPECIAL_TOKENS

transformers.logging.set_verbosity_error()


def _tensors(d: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype) over every shard in d."""
    from safetensors import safe_open

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            for n in s.keys():  # noqa: SIM118 - safe_open is not a Mapping
                sl = s.get_slice(n)
                out[n] = (tuple(sl.get_shape()), sl.get_dtype())
    return out


def _digest(d: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny preset of every architecture, bfloat16 and float32, seed 0."""
    root = tmp_path_factory.mktemp("synth")
    out = {}
    for arch in ARCHS:
        out[arch] = synthesize(root / arch, arch=arch)
        out[arch + "/f32"] = synthesize(root / f"{arch}-f32", arch=arch, dtype="float32")
    return out


# --- layout: exactly what transformers writes ------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_layout_and_config_equal_save_pretrained(
    tiny: dict[str, Path], arch: str, tmp_path: Path
) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    ours = tiny[arch]
    config = AutoConfig.from_pretrained(ours)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "ref")
    # Same names, shapes and dtypes (transformers keeps e.g. DeepSeek's router in float32).
    assert _tensors(ours) == _tensors(tmp_path / "ref")
    ours_cfg = json.loads((ours / "config.json").read_text())
    ref_cfg = json.loads((tmp_path / "ref" / "config.json").read_text())
    assert ours_cfg == ref_cfg
    assert ours_cfg["model_type"] == arch


def test_fused_experts_are_written_per_expert(tiny: dict[str, Path]) -> None:
    names = set(_tensors(tiny["qwen3_moe"]))
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in names
    assert not any(n.endswith("experts.gate_up_proj") for n in names)
    names = set(_tensors(tiny["mixtral"]))
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in names
    shapes = _tensors(tiny["gpt_oss"])
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"][0] == (8, 64, 64)  # [E, H, 2I]
    assert shapes["model.layers.0.mlp.experts.down_proj"][0] == (8, 32, 64)  # [E, I, H]
    names = set(_tensors(tiny["deepseek_v3"]))
    assert "model.layers.0.mlp.gate_proj.weight" in names  # first_k_dense_replace=1
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names


def test_index_and_provenance(tiny: dict[str, Path]) -> None:
    d = tiny["qwen2_moe"]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    tensors = _tensors(d)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(
        f.stat().st_size - 8 - int.from_bytes(f.read_bytes()[:8], "little")
        for f in d.glob("*.safetensors")
    )
    assert index["metadata"]["smoe_synth"] == {
        "arch": "qwen2_moe",
        "preset": "tiny",
        "layers": 3,
        "seed": 0,
        "dtype": "bfloat16",
    }
    assert "smoe" not in (d / "config.json").read_text()


def test_real_geometry_layout_without_weights() -> None:
    p = PRESETS["qwen3-235b-a22b"]
    config, specs = layout.build_live("qwen3_moe", p, 2, "bfloat16")
    by_name = {s.name: s for s in specs}
    assert by_name["model.layers.1.mlp.experts.127.up_proj.weight"].shape == (1536, 4096)
    assert by_name["model.layers.0.self_attn.q_proj.weight"].shape == (64 * 128, 4096)
    assert by_name["model.layers.0.self_attn.k_proj.weight"].shape == (4 * 128, 4096)
    assert by_name["model.layers.0.mlp.gate.weight"].shape == (128, 4096)
    assert 9.9e9 < sum(s.nbytes for s in specs) < 10.2e9
    assert config.num_experts_per_tok == 8 and config.head_dim == 128
    shards = weights.plan_shards(specs)
    assert all(sum(s.nbytes for s in shard) <= weights.MAX_SHARD_BYTES for shard in shards)


def test_small_shards_load_like_one(tiny: dict[str, Path], tmp_path: Path, monkeypatch) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(weights, "MAX_SHARD_BYTES", 100_000)
    d = synthesize(tmp_path / "sharded", arch="mixtral")
    files = sorted(f.name for f in d.glob("*.safetensors"))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    a = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)(ids).logits
    b = AutoModelForCausalLM.from_pretrained(tiny["mixtral"], dtype=torch.float32)(ids).logits
    assert torch.equal(a, b)


# --- determinism -----------------------------------------------------------------------------


def test_same_seed_same_bytes_other_seed_other_weights(
    tiny: dict[str, Path], tmp_path: Path
) -> None:
    again = synthesize(tmp_path / "again", arch="qwen3_moe")
    assert _digest(again) == _digest(tiny["qwen3_moe"])
    other = _digest(synthesize(tmp_path / "other", arch="qwen3_moe", seed=1))
    first = _digest(tiny["qwen3_moe"])
    assert other["model-00001-of-00001.safetensors"] != first["model-00001-of-00001.safetensors"]
    assert other["tokenizer.json"] == first["tokenizer.json"]
    assert other["config.json"] == first["config.json"]


def test_values_depend_on_name_not_on_layer_count_or_dtype(
    tiny: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    two = synthesize(tmp_path / "two", arch="qwen3_moe", layers=2)
    a = load_file(next(two.glob("*.safetensors")))
    b = load_file(next(tiny["qwen3_moe"].glob("*.safetensors")))
    f32 = load_file(next(tiny["qwen3_moe/f32"].glob("*.safetensors")))
    for name in ("model.layers.1.mlp.experts.5.down_proj.weight", "model.embed_tokens.weight"):
        assert torch.equal(a[name], b[name])
        # float32 holds exactly the bfloat16 values: both files describe one model.
        assert torch.equal(a[name].float(), f32[name])


def test_bf16_rounding_is_nearest_even() -> None:
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3.0e-3, 65504.0], dtype=np.float32)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(weights.bf16_bits(x), want)


def test_tensor_scales() -> None:
    spec = layout.TensorSpec("model.layers.0.mlp.experts.3.down_proj.weight", (64, 1536), "F32")
    v = weights.tensor_values(7, spec, weights.Init(0.0, 1 / np.sqrt(1536)))
    assert v.shape == (64 * 1536,) and abs(v.std() * np.sqrt(1536) - 1) < 0.02
    assert abs(v.mean()) < 1e-3


# --- decisiveness: transformers loads and generates ------------------------------------------


def _greedy(model, ids: list[int], steps: int = 32) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Greedy continuation with transformers' generate; per-step top-1 margins (abs, relative)."""
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=steps,
        do_sample=False,
        eos_token_id=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    logits = torch.stack(out.logits)[:, 0].double()
    top2 = logits.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).numpy()
    rel = margin / logits.abs().max(dim=-1).values.numpy()
    return out.sequences[0, len(ids) :].tolist(), margin, rel


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_generates_decisively(tiny: dict[str, Path], arch: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tiny[arch]
    tok = AutoTokenizer.from_pretrained(d)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    new, margin, rel = _greedy(model, tok.encode(prompt))
    assert len(new) == 32 and len(set(new)) >= 5, new
    # float32 frameworks agree to ~1e-6 of the largest logit (see the mlx-lm test); the margins
    # must stay far above that. (Random logits put ~1% of steps below 1e-3: no weight scale
    # changes that ratio, only the absolute margin.)
    assert rel.min() > 1e-4, (rel.min(), margin)
    assert np.mean(rel > 1e-2) >= 0.75, rel
    assert np.median(margin) > 1.5 and np.mean(margin > 1.0) > 0.6, margin
    # Routing and logits are decisive, not saturated: the weights keep activations O(1).
    h = model(torch.tensor([tok.encode(prompt)]), output_hidden_states=True).hidden_states
    assert all(0.3 < x.pow(2).mean().sqrt().item() < 5 for x in h)


def test_demo_preset_chats(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = synthesize(tmp_path / "demo", preset="demo")
    config = json.loads((d / "config.json").read_text())
    assert (config["hidden_size"], config["num_local_experts"], config["num_experts_per_tok"]) == (
        256,
        16,
        4,
    )
    tok = AutoTokenizer.from_pretrained(d)
    assert len(tok) == config["vocab_size"] == 4096
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Tell me a story."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    new, margin, rel = _greedy(model, tok.encode(ids), steps=16)
    text = tok.decode(new)
    assert len(set(new)) >= 5 and rel.min() > 1e-4
    assert "\ufffd" not in text  # stray bytes are kept out of the LM head's favourites


# --- tokenizer -------------------------------------------------------------------------------


def test_tokenizer_chat_template_with_mlx_lm(tiny: dict[str, Path]) -> None:
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer
    from mlx_lm.utils import load_tokenizer
    from transformers import AutoTokenizer

    d = tiny["qwen3_moe"]
    config = json.loads((d / "config.json").read_text())
    gen = json.loads((d / "generation_config.json").read_text())
    hf = AutoTokenizer.from_pretrained(d)
    assert len(hf) == config["vocab_size"] == 512
    assert [hf.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert hf.eos_token_id == config["eos_token_id"] == 2
    assert hf.pad_token_id == config["pad_token_id"] == 0
    assert gen["eos_token_id"] == [2, 0]

    wrapped = load_tokenizer(d)
    assert isinstance(wrapped.detokenizer, BPEStreamingDetokenizer)
    assert 2 in wrapped.eos_token_ids
    ids = wrapped.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    text = hf.decode(ids)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0] == 1 and ids.count(2) == 1
    sample = "Hello, world! Ünïcödé 123"
    assert hf.decode(hf.encode(sample)) == sample
    # Every id the model can emit decodes (no holes in the vocabulary).
    assert all(hf.convert_ids_to_tokens(i) is not None for i in range(config["vocab_size"]))


def test_tokenizer_training_is_deterministic_across_processes() -> None:
    from smoe.synth.tokenizer import train

    code = "import hashlib,sys; from smoe.synth.tokenizer import train; print(hashlib.sha256(train(4096).encode()).hexdigest())"
    runs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    assert runs == {hashlib.sha256(train(4096).encode()).hexdigest()}


# --- mlx-lm loads the checkpoint and agrees with transformers ------------------------------


def _mlx_config(d: Path) -> dict:
    """transformers 5 writes num_local_experts and rope_parameters; mlx-lm's ModelArgs want the
    pre-5 spellings (num_experts, rope_theta, rope_scaling)."""
    c = json.loads((d / "config.json").read_text())
    rope = dict(c["rope_parameters"])
    extra: dict = {"rope_theta": rope.pop("rope_theta")}
    if rope.get("rope_type", "default") != "default":
        extra["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    if "num_local_experts" in c:
        extra["num_experts"] = c["num_local_experts"]
    return extra


# gpt_oss is left out: mlx-lm only reads its MXFP4 layout ([E, 2I, H] blocks), not the
# unquantized [E, H, 2I] tensors that transformers' save_pretrained writes.
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "gpt_oss"])
def test_mlx_lm_loads_and_matches_transformers(tiny: dict[str, Path], arch: str) -> None:
    import mlx.core as mx
    from mlx_lm.utils import load_model
    from transformers import AutoModelForCausalLM

    # Loads the bfloat16 files as they are (strict: every tensor used, none missing)...
    load_model(tiny[arch], model_config=_mlx_config(tiny[arch]))
    # ...but mlx's CPU gather_mm is float32-only, so run the float32 twin (same values).
    d = tiny[arch + "/f32"]
    model, _ = load_model(d, model_config=_mlx_config(d))
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = [1, 87, 85, 261, 201, 74, 75, 2, 201, 1, 67]
    got = torch.tensor(model(mx.array([ids]))[0].tolist())
    want = ref(torch.tensor([ids])).logits[0]
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    want_ids, _, _ = _greedy(ref, ids)
    seq = list(ids)
    for _ in range(32):
        seq.append(int(mx.argmax(model(mx.array([seq]))[0, -1]).item()))
    assert seq[len(ids) :] == want_ids


# --- errors and atomic output ----------------------------------------------------------------


def test_bad_choices_list_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(SmoeError, match="qwen3_moe, qwen2_moe, mixtral"):
        synthesize(tmp_path / "x", arch="llama")
    with pytest.raises(SmoeError, match="tiny, demo, qwen3-30b-a3b, qwen3-235b-a22b"):
        synthesize(tmp_path / "x", preset="huge")
    with pytest.raises(SmoeError, match="supports only qwen3_moe"):
        synthesize(tmp_path / "x", arch="mixtral", preset="qwen3-30b-a3b")
    with pytest.raises(SmoeError, match="bfloat16, float16, float32"):
        synthesize(tmp_path / "x", dtype="int8")
    with pytest.raises(SmoeError, match="at least 2"):
        synthesize(tmp_path / "x", arch="deepseek_v3", layers=1)
    assert not (tmp_path / "x").exists()


def test_existing_output_needs_force(tiny: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(SmoeError, match="--force"):
        synthesize(out, arch="olmoe")
    assert (out / "keep.txt").read_text() == "mine"

    with pytest.raises(SmoeError, match="not a checkpoint"):
        synthesize(out, arch="olmoe", force=True)  # --force never deletes a non-checkpoint
    assert (out / "keep.txt").read_text() == "mine"
    (out / "config.json").write_text("{}")  # now it looks like a checkpoint

    seen: list[tuple[str, int, int]] = []
    synthesize(out, arch="olmoe", force=True, progress=lambda *a: seen.append(a))
    assert not (out / "keep.txt").exists()
    assert _digest(out) == _digest(tiny["olmoe"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp or old dirs left
    done = [d for s, d, _ in seen if s == "weights"]
    assert done == sorted(done) and seen[-1][1] == seen[-1][2] > 0

    empty = tmp_path / "empty"
    empty.mkdir()
    synthesize(empty, arch="olmoe")  # an empty directory is not in the way
    assert (empty / "config.json").exists()


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
def test_failure_mid_write_leaves_nothing(
    tmp_path: Path, monkeypatch, error: BaseException
) -> None:
    calls = []

    def failing(f, data):
        calls.append(1)
        if len(calls) == 20:
            raise error
        f.write(memoryview(data).cast("B"))

    monkeypatch.setattr(weights, "write_chunk", failing)
    with pytest.raises(type(error)):
        synthesize(tmp_path / "ckpt", arch="qwen2_moe")
    assert len(calls) == 20
    assert list(tmp_path.iterdir()) == []


def test_failure_keeps_the_old_checkpoint_under_force(
    tiny: dict[str, Path], tmp_path: Path, monkeypatch
) -> None:
    out = synthesize(tmp_path / "ckpt", arch="mixtral")
    before = _digest(out)

    def failing(f, data):
        raise OSError("disk full")

    monkeypatch.setattr(weights, "write_chunk", failing)
    with pytest.raises(OSError):
        synthesize(out, arch="mixtral", seed=3, force=True)
    assert _digest(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_leftovers_of_killed_runs_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    stale = tmp_path / f".ckpt.tmp-{dead.stdout.strip()}"
    stale.mkdir()
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"partial")
    unrelated = tmp_path / ".other.tmp-1"
    unrelated.mkdir()
    synthesize(tmp_path / "ckpt", arch="mixtral")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp-1", "ckpt"]
