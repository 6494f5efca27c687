"""Topology detection and config normalisation."""

from __future__ import annotations

import pytest

from smoe.errors import CheckpointError, UnsupportedModelError
from smoe.models.checkpoint import open_checkpoint
from smoe.models.topology import moe_model_types, normalize_config
from tests.conftest import HF_ARCHS


def test_moe_types_come_from_mlx_lm():
    types = moe_model_types()
    for arch in (
        "qwen3_moe",
        "qwen2_moe",
        "mixtral",
        "olmoe",
        "deepseek_v2",
        "deepseek_v3",
        "gpt_oss",
        "glm4_moe",
    ):
        assert arch in types
    assert "llama" not in types


def test_transformers5_spellings_are_filled_in():
    cfg = normalize_config(
        {
            "model_type": "qwen3_moe",
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"},
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "moe_intermediate_size": 64,
            "vocab_size": 128,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 512,
            "tie_word_embeddings": False,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    )
    assert cfg["num_experts"] == 8 and cfg["num_local_experts"] == 8
    assert cfg["rope_theta"] == 5000.0
    assert cfg["head_dim"] == 16
    assert "rope_scaling" not in cfg or cfg["rope_scaling"] is None


def test_explicit_values_win():
    cfg = normalize_config(
        {
            "model_type": "mixtral",
            "num_local_experts": 8,
            "rope_theta": 1.0,
            "rope_parameters": {"rope_theta": 2.0},
        }
    )
    assert cfg["rope_theta"] == 1.0


def test_yarn_rope_parameters_become_rope_scaling():
    cfg = normalize_config(
        {
            "model_type": "deepseek_v3",
            "rope_parameters": {
                "rope_theta": 10000.0,
                "rope_type": "yarn",
                "factor": 40.0,
                "original_max_position_embeddings": 4096,
            },
        }
    )
    assert cfg["rope_scaling"]["factor"] == 40.0 and cfg["rope_scaling"]["type"] == "yarn"


def test_unknown_type():
    with pytest.raises(UnsupportedModelError, match="not implemented by mlx-lm"):
        normalize_config({"model_type": "nope"})
    with pytest.raises(CheckpointError, match="model_type"):
        normalize_config({})


@pytest.mark.parametrize("arch", sorted(HF_ARCHS))
def test_topology_of_each_arch(arch, hf_dir):
    ck = open_checkpoint(hf_dir(arch))
    t = ck.topology
    assert t.model_type == arch
    assert t.num_experts == 8 and t.experts_per_token == 2
    dense_first = arch.startswith("deepseek")
    assert list(t.moe_layers) == ([1, 2] if dense_first else [0, 1])
    assert t.shared_experts == (1 if arch in ("qwen2_moe", "deepseek_v2", "deepseek_v3") else 0)
    assert t.expert_kind == "SwitchGLU"
