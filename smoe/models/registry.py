"""Everything S-MoE knows per model architecture, in one table (``ARCHITECTURES``).

mlx-lm's one-file-per-architecture model code does the math; what S-MoE adds per
architecture is small and lives here, each entry saying why:
- ``batched_decode``: decoding several sequences in one pass is tested against solo decode
  for it (tests/exact/test_batching.py); others decode a batch one sequence after another;
- ``batched_attention``: its attention module follows mlx-lm's common pattern (RoPE at
  ``cache.offset``, ``update_and_fetch``, the module's attention function), so a batch runs
  it once with only those parts per row (smoe.compute.rowwise); others (DeepSeek-V3's
  latent attention computes on the fetched keys) run the whole module once per row;
- ``prompt_pass``: prefill may run layer-major over the whole prompt (one read of each
  expert per layer and prompt: smoe.compute.prompt_pass), because what a chunk computes
  before its first layer (masks) reads only the first layer's cache, or nothing that
  depends on the cache's fill (checked against mlx-lm's model files; a function of the
  config where it depends on it); others prefill chunk by chunk;
- ``source_adapter``: turns a transformers float checkpoint into the layout mlx-lm's
  ``sanitize`` reads, where the two differ;
- ``config_fixup``: completes a normalised config.json where mlx-lm needs more;
- ``synth_config``: the transformers config keywords `smoe synth` writes for a preset
  (beside the keywords every architecture shares), and ``min_layers``, ``sigmoid_router``
  for the weights it draws.
No MLX import: the adapters work on any array with ``ndim`` and ``swapaxes``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# DeepSeek-V2(-Lite)'s own YaRN settings: mlx-lm's deepseek_v2 requires rope scaling.
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
class Architecture:
    model_type: str
    synth_config: Callable[[Any], dict[str, Any]]  # preset -> transformers config kwargs
    batched_decode: bool = True
    batched_attention: bool = True
    source_adapter: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    config_fixup: Callable[[dict[str, Any]], None] | None = None
    min_layers: int = 1  # synth: DeepSeek's first layer is dense, so it needs two
    sigmoid_router: bool = False  # synth: the router scores with a sigmoid (DeepSeek-V3)
    prompt_pass: Callable[[dict[str, Any]], bool] = lambda config: True


def _gpt_oss_prompt_pass(config: dict[str, Any]) -> bool:
    """gpt_oss builds its sliding-window mask from the cache of its first sliding layer,
    and that mask depends on the cache's fill: layer-major only where that is layer 0 (its
    full-attention mask is "causal", whatever the fill)."""
    types = config.get("layer_types") or ["sliding_attention"]
    return "sliding_attention" not in types or types[0] == "sliding_attention"


def _adapt_transformers_gpt_oss(weights: dict[str, Any]) -> dict[str, Any]:
    """transformers' float gpt_oss experts -> the layout mlx-lm's gpt_oss sanitize reads.

    transformers stores ``experts.gate_up_proj`` as [E, in, out] (interleaved gate/up
    columns); mlx-lm's sanitize expects OpenAI's [E, out, in] with a ``.weight`` suffix.
    """
    out = {}
    for k, v in weights.items():
        if k.endswith((".experts.gate_up_proj", ".experts.down_proj")) and v.ndim == 3:
            out[k + ".weight"] = v.swapaxes(-1, -2)
        else:
            out[k] = v
    return out


def _deepseek_v2_rope(config: dict[str, Any]) -> None:
    """mlx-lm's deepseek_v2 always builds its YaRN rope; a factor of 1 is plain RoPE."""
    if config.get("rope_scaling") is None:
        config["rope_scaling"] = {"type": "yarn", "factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0}


def _qwen3_moe(p: Any) -> dict[str, Any]:
    return dict(
        head_dim=p.head_dim,
        num_experts=p.experts,
        moe_intermediate_size=p.moe_intermediate,
        intermediate_size=p.dense_intermediate,
        norm_topk_prob=True,  # as in the released Qwen3 MoE checkpoints
    )


def _qwen2_moe(p: Any) -> dict[str, Any]:
    return dict(
        num_experts=p.experts,
        moe_intermediate_size=p.moe_intermediate,
        intermediate_size=p.dense_intermediate,
        shared_expert_intermediate_size=p.dense_intermediate,
    )


def _local_experts(p: Any) -> dict[str, Any]:  # mixtral, gpt_oss
    return dict(
        head_dim=p.head_dim, num_local_experts=p.experts, intermediate_size=p.moe_intermediate
    )


def _olmoe(p: Any) -> dict[str, Any]:
    return dict(num_experts=p.experts, intermediate_size=p.moe_intermediate)


def _deepseek(p: Any) -> dict[str, Any]:
    return dict(
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


def _deepseek_v2(p: Any) -> dict[str, Any]:
    return _deepseek(p) | dict(
        rope_parameters=dict(DEEPSEEK_V2_YARN), max_position_embeddings=163840
    )


ARCHITECTURES: dict[str, Architecture] = {
    a.model_type: a
    for a in (
        Architecture("qwen3_moe", _qwen3_moe),
        Architecture("qwen2_moe", _qwen2_moe),
        Architecture("mixtral", _local_experts),
        Architecture("olmoe", _olmoe),
        Architecture("deepseek_v2", _deepseek_v2, config_fixup=_deepseek_v2_rope, min_layers=2),
        Architecture(
            "deepseek_v3", _deepseek, min_layers=2, sigmoid_router=True, batched_attention=False
        ),
        Architecture(
            "gpt_oss",
            _local_experts,
            source_adapter=_adapt_transformers_gpt_oss,
            prompt_pass=_gpt_oss_prompt_pass,
        ),
    )
}


def layer_major_prefill(config: dict[str, Any]) -> bool:
    """Whether a model of this config may prefill layer-major (``prompt_pass`` above);
    False for an architecture S-MoE does not know."""
    arch = architecture(str(config.get("model_type")))
    return arch is not None and arch.prompt_pass(config)


def architecture(model_type: str) -> Architecture | None:
    """The entry for ``model_type``; None for a model S-MoE has no knowledge of (mlx-lm
    may still run it: it then gets the defaults, one sequence at a time)."""
    return ARCHITECTURES.get(model_type)
