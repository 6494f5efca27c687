"""Shared fixtures: tiny checkpoints written by transformers itself (the reference we
did not write), converted vaults, and a CLI runner."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

pytest_plugins = ["tests._isolated_cache"]  # the suite's own SMOE_CACHE

# Small but quantizable at group 64: every expert matrix's input dim is 64 or 128.
_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    eos_token_id=1,
    bos_token_id=0,
    pad_token_id=0,
)

# arch -> (config class name, model class name, extra config)
HF_ARCHS: dict[str, tuple[str, str, dict]] = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=128,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=8, num_experts_per_tok=2),
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2)),
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            n_shared_experts=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            num_key_value_heads=4,
            num_hidden_layers=3,
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            num_key_value_heads=4,
            num_hidden_layers=3,
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64, head_dim=16),
    ),
}


def make_hf_checkpoint(out: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Save a random model of ``arch`` with transformers' own save_pretrained."""
    import torch
    import transformers

    cfg_name, model_name, extra = HF_ARCHS[arch]
    kwargs = {**_COMMON, **extra, **overrides}
    config = getattr(transformers, cfg_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.bfloat16)
    model.save_pretrained(out)
    return out


def pytest_asyncio_loop_factories(config, item):
    """Every async test runs twice: on asyncio's own loop and on uvloop, the loop every
    `smoe` command runs on (smoe.util.loop)."""
    import asyncio

    from smoe.util.loop import loop_factory

    factories = {"asyncio": asyncio.new_event_loop}
    uv = loop_factory()
    if uv is not None:
        factories["uvloop"] = uv
    return factories


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    """Factory: a cached transformers checkpoint per arch (built once per session)."""
    root = tmp_path_factory.mktemp("hf")

    def get(arch: str) -> Path:
        path = root / arch
        if not path.exists():
            make_hf_checkpoint(path, arch)
        return path

    return get


@pytest.fixture
def copy_dir(tmp_path):
    """Copy a checkpoint so a test can damage it."""

    def copy(src: Path, name: str = "ck") -> Path:
        dst = tmp_path / name
        shutil.copytree(src, dst)
        return dst

    return copy


def tiny_vault(root: Path, seed: int):
    """A `smoe synth --preset tiny` qwen3_moe converted with float32 scales (the CPU's fast
    dtype): the engine tests' usual model. Each test module makes its own, because engines
    write per-vault state (popularity counts) that must not leak between modules."""
    from smoe.synth import synthesize
    from smoe.vault.convert import ConvertOptions, convert

    src = synthesize(root / "src", arch="qwen3_moe", preset="tiny", seed=seed)
    return convert(src, root / "v", ConvertOptions(dtype="float32"))


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    path.write_text(json.dumps(data))


def rewrite_side_file(vault_dir: Path, name: str, data: bytes | None) -> None:
    """Replace (``data`` None: remove) a file the vault copied from its source (a tokenizer
    or template file) and record it in the manifest, signed again: what a conversion from
    a source holding ``data`` would have written (for tests of what such a file does)."""
    from smoe.vault.format import file_checksum
    from smoe.vault.manifest import SIGNATURE, sign_manifest

    manifest = json.loads((vault_dir / "manifest.json").read_text())
    manifest.pop(SIGNATURE, None)
    source, path = manifest["source"], vault_dir / name
    if data is None:
        path.unlink(missing_ok=True)
        source["copied"] = [n for n in source.get("copied", []) if n != name]
        source.get("checksums", {}).pop(name, None)
    else:
        path.write_bytes(data)
        source.setdefault("checksums", {})[name] = file_checksum(path)
    (vault_dir / "manifest.json").write_text(json.dumps(sign_manifest(manifest)))


@pytest.fixture
def run_cli(capsys):
    """Run `smoe ...` in-process; return (exit code, stdout, stderr)."""
    from smoe.cli import main

    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()  # drop what fixtures printed
        code = main([str(a) for a in argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run
