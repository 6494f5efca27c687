"""Geometry presets for synthetic checkpoints, and their translation into each architecture's config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smoe.errors import SmoeError
from smoe.models.registry import ARCHITECTURES

# Hugging Face model_type values that `smoe synth` can write: every known architecture.
ARCHS: tuple[str, ...] = tuple(ARCHITECTURES)

# Token ids fixed by the synthetic tokenizer (smoe.synth.tokenizer.SPECIAL_TOKENS order).
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2


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
    least = ARCHITECTURES[arch].min_layers
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
    return kw | {"num_experts_per_tok": p.top_k} | ARCHITECTURES[arch].synth_config(p)
