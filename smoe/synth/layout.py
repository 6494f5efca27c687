"""What transformers' `save_pretrained` would write for a config: tensor names, shapes, dtypes.

The model is built on the meta device (no memory behind its tensors) and its state dict goes
through the same tied-weight removal and reverse weight conversion that `save_pretrained` applies,
so fused in-memory experts come out in the per-expert on-disk layout transformers itself writes.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smoe.synth.presets import Preset, config_kwargs

# dtype name -> (torch attribute, safetensors dtype, bytes per element)
DTYPES: dict[str, tuple[str, str, int]] = {
    "bfloat16": ("bfloat16", "BF16", 2),
    "float16": ("float16", "F16", 2),
    "float32": ("float32", "F32", 4),
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype: BF16, F16 or F32

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * {"BF16": 2, "F16": 2, "F32": 4}[self.dtype]


def natural_key(name: str) -> tuple[Any, ...]:
    """Sort key that puts layer 2 before layer 10 (and expert 2 before expert 10)."""
    return tuple((0, int(t)) if t.isdigit() else (1, t) for t in re.split(r"(\d+)", name))


FROZEN_DIR = Path(__file__).parent / "frozen"


@dataclass(frozen=True)
class FrozenConfig:
    """A saved config.json text, standing in for the transformers config object."""

    text: str

    def to_json_string(self, use_diff: bool = True) -> str:
        return self.text

    @property
    def max_position_embeddings(self) -> int:
        return int(json.loads(self.text)["max_position_embeddings"])


def frozen_path(arch: str, preset: str, layers: int, dtype: str) -> Path:
    return FROZEN_DIR / f"{arch}-{preset}-{layers}-{dtype}.json"


def freeze(arch: str, preset: str, p: Preset, layers: int, dtype: str) -> Path:
    """Record build()'s result so that this checkpoint can be made without torch (the
    built-in demo must work after a plain `pip install`)."""
    config, specs = build_live(arch, p, layers, dtype)
    path = frozen_path(arch, preset, layers, dtype)
    data = {
        "config": config.to_json_string(use_diff=True),
        "specs": [[s.name, list(s.shape), s.dtype] for s in specs],
    }
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    return path


def build(
    arch: str, preset: str, p: Preset, layers: int, dtype: str
) -> tuple[Any, list[TensorSpec]]:
    """(config ready to save, on-disk tensor specs in writing order): from the frozen copy
    when one ships for this combination, else from transformers (needs torch)."""
    path = frozen_path(arch, preset, layers, dtype)
    if path.exists():
        data = json.loads(path.read_text())
        specs = [TensorSpec(n, tuple(shape), dt) for n, shape, dt in data["specs"]]
        return FrozenConfig(data["config"]), specs
    try:
        import torch  # noqa: F401
    except ImportError:
        from smoe.errors import SmoeError

        raise SmoeError(
            f"synthesising {arch}/{preset} needs PyTorch (for transformers' layout): "
            "pip install torch (CPU build) or the test extra"
        ) from None
    return build_live(arch, p, layers, dtype)


def build_live(arch: str, p: Preset, layers: int, dtype: str) -> tuple[Any, list[TensorSpec]]:
    """Return (transformers config ready to save, on-disk tensor specs in writing order)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    torch_dtype = getattr(torch, DTYPES[dtype][0])
    config = AutoConfig.for_model(arch, **config_kwargs(arch, p, layers))
    # transformers warns about unused config keys and such at INFO/WARNING; none of it matters here.
    tf_logger = logging.getLogger("transformers")
    level = tf_logger.level
    tf_logger.setLevel(logging.ERROR)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        state = remove_tied_weights_from_state_dict(model.state_dict(), model)
        state = revert_weight_conversion(model, state)
    finally:
        tf_logger.setLevel(level)

    # What save_pretrained records about the model it saves.
    config = model.config
    config.architectures = [type(model).__name__]
    config.dtype = torch_dtype
    to_st = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
    specs = []
    for name in sorted(state, key=natural_key):
        t = state[name]
        if t.dtype not in to_st:
            raise AssertionError(f"{arch}: unexpected dtype {t.dtype} for {name}")
        # Some modules are kept in float32 by transformers (e.g. DeepSeek's router): same on disk.
        specs.append(TensorSpec(name, tuple(int(d) for d in t.shape), to_st[t.dtype]))
    return config, specs
