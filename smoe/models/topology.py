"""Model topology: read a checkpoint's config, normalise it for mlx-lm, describe its experts.

Checkpoints in the wild spell the same thing several ways (transformers 5 writes
``num_local_experts`` and ``rope_parameters``; older exports ``num_experts`` and
``rope_theta``). mlx-lm's ``ModelArgs`` wants one spelling per architecture, so we fill
in the spelling each architecture's ``ModelArgs`` asks for, and never drop what is given.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from smoe.errors import CheckpointError, UnsupportedModelError
from smoe.models.registry import architecture
from smoe.util.files import NotRegularFile, open_regular

# Each group lists spellings of one quantity; the first that is present fills the others.
_ALIASES: tuple[tuple[str, ...], ...] = (
    ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
    ("num_experts_per_tok", "num_experts_per_token", "moe_top_k", "top_k", "n_activated_experts"),
    ("moe_intermediate_size", "expert_intermediate_size"),
    ("n_shared_experts", "num_shared_experts"),
)

# Keys whose value, for the configs we know, tells the expert count / top-k in the end.
EXPERT_COUNT_KEYS = _ALIASES[0]
TOP_K_KEYS = _ALIASES[1]


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object, with an error that names the file when it is unreadable."""
    try:
        with open_regular(path) as f:  # a FIFO would block the read forever
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except NotRegularFile as e:
        raise CheckpointError(f"{path} is {e.kind}, not a regular file; restore the file") from None
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); restore the file") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def load_config(model_dir: Path) -> dict[str, Any]:
    """config.json of a checkpoint, with generation_config.json's EOS ids folded in."""
    config = read_json(model_dir / "config.json")
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        gen = read_json(gen_path)
        if gen.get("eos_token_id") is not None:
            config["eos_token_id"] = gen["eos_token_id"]
    return config


@cache
def moe_model_types() -> tuple[str, ...]:
    """mlx-lm model types whose experts are SwitchGLU/SwitchMLP modules (from its sources)."""
    import mlx_lm.models as models

    root = Path(models.__file__).parent
    found = []
    for path in sorted(root.glob("*.py")):
        if path.stem == "switch_layers":
            continue
        text = path.read_text(errors="replace")
        if re.search(r"\bSwitch(GLU|MLP)\(", text):
            found.append(path.stem)
    return tuple(found)


def model_classes(config: dict[str, Any]) -> tuple[type, type]:
    """mlx-lm's (Model, ModelArgs) classes for a config, or a clear error."""
    model_type = config.get("model_type")
    if not model_type:
        raise CheckpointError(
            "config.json has no 'model_type'; it is not a transformers checkpoint"
        )
    from mlx_lm.utils import MODEL_REMAPPING

    module_name = MODEL_REMAPPING.get(model_type, model_type)
    try:
        arch = importlib.import_module(f"mlx_lm.models.{module_name}")
    except ImportError:
        raise UnsupportedModelError(
            f"model_type '{model_type}' is not implemented by mlx-lm, which S-MoE builds on; "
            f"supported MoE types: {', '.join(moe_model_types())}"
        ) from None
    return arch.Model, arch.ModelArgs


def _required_fields(args_class: type) -> set[str]:
    if dataclasses.is_dataclass(args_class):
        return {
            f.name
            for f in dataclasses.fields(args_class)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
    params = inspect.signature(args_class).parameters.values()
    return {p.name for p in params if p.default is inspect.Parameter.empty}


def _accepted_fields(args_class: type) -> set[str]:
    return set(inspect.signature(args_class).parameters)


def normalize_config(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` with the key spellings mlx-lm's ModelArgs for its type expects.

    Only adds keys: whatever the checkpoint states is kept as it is.
    """
    out = dict(config)
    _, args_class = model_classes(out)
    accepted = _accepted_fields(args_class)

    for group in _ALIASES:
        value = next((out[k] for k in group if out.get(k) is not None), None)
        if value is None:
            continue
        for key in group:
            if key in accepted and out.get(key) is None:
                out[key] = value

    # transformers 5 folds rope settings into rope_parameters.
    rope = out.get("rope_parameters")
    if isinstance(rope, dict):
        if out.get("rope_theta") is None and rope.get("rope_theta") is not None:
            out["rope_theta"] = rope["rope_theta"]
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if out.get("rope_scaling") is None and rope_type not in (None, "default"):
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            scaling.setdefault("type", rope_type)
            out["rope_scaling"] = scaling

    if "head_dim" in accepted and out.get("head_dim") is None:
        heads = out.get("num_attention_heads")
        if heads and out.get("hidden_size"):
            out["head_dim"] = out["hidden_size"] // heads

    arch = architecture(str(out.get("model_type")))
    if arch is not None and arch.config_fixup is not None:
        arch.config_fixup(out)  # what mlx-lm's model of this architecture needs more

    missing = sorted(k for k in _required_fields(args_class) if out.get(k) is None)
    if missing:
        raise CheckpointError(
            f"config.json lacks {', '.join(missing)}, which mlx-lm's "
            f"'{out['model_type']}' model needs; add them to config.json"
        )
    return out


def _first(config: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((config[k] for k in keys if config.get(k) is not None), None)


@dataclass(frozen=True)
class ExpertModule:
    """One MoE layer's routed experts: where mlx-lm keeps them, and their stacked shapes."""

    layer: int
    path: str  # e.g. "model.layers.3.mlp.switch_mlp"
    kind: str  # "SwitchGLU" or "SwitchMLP"


@dataclass(frozen=True)
class Topology:
    """What S-MoE needs to know about a MoE model, independent of its weights' encoding."""

    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_experts: int
    experts_per_token: int
    expert_hidden_size: int
    expert_kind: str
    moe_layers: tuple[int, ...]
    shared_experts: int
    num_attention_heads: int | None
    num_key_value_heads: int | None
    head_dim: int | None
    tie_word_embeddings: bool
    max_position_embeddings: int | None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["moe_layers"] = list(self.moe_layers)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Topology:
        d = dict(d)
        d["moe_layers"] = tuple(d["moe_layers"])
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(path: str) -> int:
    """The decoder layer index in a module path such as 'model.layers.7.mlp.switch_mlp'."""
    m = _LAYER_RE.search(path + ".")
    if not m:
        raise UnsupportedModelError(f"cannot tell which layer the experts at '{path}' belong to")
    return int(m.group(1))


def find_expert_modules(model: Any) -> list[ExpertModule]:
    """Every SwitchGLU/SwitchMLP in an mlx-lm model, in layer order."""
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    found = [
        ExpertModule(layer_of(name), name, type(module).__name__)
        for name, module in model.named_modules()
        if isinstance(module, (SwitchGLU, SwitchMLP))
    ]
    found.sort(key=lambda m: m.layer)
    layers = [m.layer for m in found]
    if len(set(layers)) != len(layers):
        raise UnsupportedModelError(
            "this model has more than one routed-expert block per layer; S-MoE vault v1 "
            "supports one"
        )
    return found


def describe(config: dict[str, Any], model: Any, modules: list[ExpertModule]) -> Topology:
    """The Topology of an instantiated mlx-lm model whose expert modules were found."""
    if not modules:
        raise UnsupportedModelError(
            f"'{config.get('model_type')}' is a dense model (no routed experts): there is "
            "nothing to stream; run it with mlx-lm directly"
        )
    first = model
    for part in modules[0].path.split("."):
        first = first[int(part)] if part.isdigit() else getattr(first, part)
    proj = first.gate_proj if modules[0].kind == "SwitchGLU" else first.fc1
    num_experts, expert_hidden = proj.weight.shape[0], proj.weight.shape[1]
    top_k = _first(config, TOP_K_KEYS)
    if top_k is None:
        raise CheckpointError(
            "config.json does not say how many experts each token uses "
            f"(one of {', '.join(TOP_K_KEYS)}); add it"
        )
    shared = _first(config, ("n_shared_experts", "num_shared_experts")) or 0
    if not shared and any(k in config and config[k] for k in ("shared_expert_intermediate_size",)):
        shared = 1
    heads = config.get("num_attention_heads")
    return Topology(
        model_type=config["model_type"],
        num_layers=int(config.get("num_hidden_layers", len(model.layers))),
        hidden_size=int(config["hidden_size"]),
        vocab_size=int(config["vocab_size"]),
        num_experts=int(num_experts),
        experts_per_token=int(top_k),
        expert_hidden_size=int(expert_hidden),
        expert_kind=modules[0].kind,
        moe_layers=tuple(m.layer for m in modules),
        shared_experts=int(shared),
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim"),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=config.get("max_position_embeddings"),
    )
