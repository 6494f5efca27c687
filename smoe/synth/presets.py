"""Geometry presets for synthetic checkpoints, and their translation into each architecture's config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smoe.errors import SmoeError

# Hugging Face model_type values that `smoe synth` can write.
ARCHS: tuple[str, ...] = (
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
)

# Token ids fixed by the synthetic tokenizer (smoe.synth.tokenizer.SPECIAL_TOKENS order).
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2

DEEPSEEK_V2_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}


@dataclass(frozen=True)
class Preset:
    """Model geometry, independent of the architecture that realises it."""

    name: str
    description: str
    hidden: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    moe_intermediate: int
    dense_intermediate: int  # dense MLP layers (DeepSeek's first layer) and shared experts
    archs: tuple[str, ...] = ARCHS
    rope_theta: float | None = None  # None: the architecture's transformers default
    max_positions: int | None = None


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="tiny",
            description="unit tests: hidden 64, 8 experts top-2, 3 layers, vocab 512 (~0.5 MB)",
            hidden=64,
            layers=3,
            vocab=512,
            heads=4,
            kv_heads=2,
            head_dim=16,
            experts=8,
            top_k=2,
            moe_intermediate=32,
            dense_intermediate=128,
        ),
        Preset(
            name="demo",
            description="random-weight demo for tests: hidden 256, 16 experts top-4, 6 layers, vocab 4096 (~25 MB)",
            hidden=256,
            layers=6,
            vocab=4096,
            heads=8,
            kv_heads=2,
            head_dim=32,
            experts=16,
            top_k=4,
            moe_intermediate=128,
            dense_intermediate=512,
        ),
        Preset(
            name="qwen3-30b-a3b",
            description="Qwen3-30B-A3B layer geometry (128 experts top-8, hidden 2048), 2 layers, vocab 4096 (~2.5 GB)",
            hidden=2048,
            layers=2,
            vocab=4096,
            heads=32,
            kv_heads=4,
            head_dim=128,
            experts=128,
            top_k=8,
            moe_intermediate=768,
            dense_intermediate=6144,
            archs=("qwen3_moe",),
            rope_theta=1_000_000.0,
            max_positions=40960,
        ),
        Preset(
            name="qwen3-235b-a22b",
            description="Qwen3-235B-A22B layer geometry (128 experts top-8, hidden 4096), 2 layers, vocab 4096 (~10 GB)",
            hidden=4096,
            layers=2,
            vocab=4096,
            heads=64,
            kv_heads=4,
            head_dim=128,
            experts=128,
            top_k=8,
            moe_intermediate=1536,
            dense_intermediate=12288,
            archs=("qwen3_moe",),
            rope_theta=1_000_000.0,
            max_positions=40960,
        ),
    )
}


def resolve(arch: str, preset: str, layers: int | None) -> tuple[Preset, int]:
    """Validate the user's choices; return the preset and the layer count to build."""
    if arch not in ARCHS:
        raise SmoeError(f"unknown architecture {arch!r}; choose one of: {', '.join(ARCHS)}")
    if preset not in PRESETS:
        raise SmoeError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    p = PRESETS[preset]
    if arch not in p.archs:
        raise SmoeError(
            f"preset {preset!r} supports only {', '.join(p.archs)}; "
            f"use --arch {p.archs[0]} or a preset for {arch} (tiny, demo)"
        )
    n = p.layers if layers is None else layers
    # DeepSeek's first layer is dense, so it needs two to contain any experts.
    least = 2 if arch.startswith("deepseek") else 1
    if n < least:
        raise SmoeError(f"--layers must be at least {least} for {arch}, got {n}")
    return p, n


def config_kwargs(arch: str, p: Preset, layers: int) -> dict[str, Any]:
    """Keyword arguments for `transformers.AutoConfig.for_model(arch, ...)`."""
    kw: dict[str, Any] = dict(
        vocab_size=p.vocab,
        hidden_size=p.hidden,
        num_hidden_layers=layers,
        num_attention_heads=p.heads,
        num_key_value_heads=p.kv_heads,
        tie_word_embeddings=False,
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
        pad_token_id=ENDOFTEXT_ID,
    )
    if p.max_positions is not None:
        kw["max_position_embeddings"] = p.max_positions
    if p.rope_theta is not None:
        kw["rope_theta"] = p.rope_theta
    moe = dict(num_experts_per_tok=p.top_k)
    if arch == "qwen3_moe":
        kw |= moe | dict(
            head_dim=p.head_dim,
            num_experts=p.experts,
            moe_intermediate_size=p.moe_intermediate,
            intermediate_size=p.dense_intermediate,
            norm_topk_prob=True,  # as in the released Qwen3 MoE checkpoints
        )
    elif arch == "qwen2_moe":
        kw |= moe | dict(
            num_experts=p.experts,
            moe_intermediate_size=p.moe_intermediate,
            intermediate_size=p.dense_intermediate,
            shared_expert_intermediate_size=p.dense_intermediate,
        )
    elif arch == "mixtral":
        kw |= moe | dict(
            head_dim=p.head_dim, num_local_experts=p.experts, intermediate_size=p.moe_intermediate
        )
    elif arch == "olmoe":
        kw |= moe | dict(num_experts=p.experts, intermediate_size=p.moe_intermediate)
    elif arch in ("deepseek_v2", "deepseek_v3"):
        kw |= moe | dict(
            num_key_value_heads=p.heads,  # MLA: every head has its own keys and values
            n_routed_experts=p.experts,
            n_shared_experts=1,
            moe_intermediate_size=p.moe_intermediate,
            intermediate_size=p.dense_intermediate,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            qk_nope_head_dim=p.head_dim,
            qk_rope_head_dim=p.head_dim // 2,
            v_head_dim=p.head_dim,
            kv_lora_rank=2 * p.head_dim,
            q_lora_rank=3 * p.hidden // 4,
        )
        if arch == "deepseek_v2":
            # DeepSeek-V2(-Lite)'s own YaRN settings: mlx-lm's deepseek_v2 requires rope scaling.
            kw |= dict(rope_parameters=dict(DEEPSEEK_V2_YARN), max_position_embeddings=163840)
    elif arch == "gpt_oss":
        kw |= moe | dict(
            head_dim=p.head_dim, num_local_experts=p.experts, intermediate_size=p.moe_intermediate
        )
    else:  # pragma: no cover - ARCHS and this table must agree
        raise AssertionError(arch)
    return kw
