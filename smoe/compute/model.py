"""Build mlx-lm's model for a vault: the backbone resident, the routed experts streamed.

The model class is mlx-lm's own for the vault's model_type. Its backbone weights come from
backbone.safetensors (quantized as config.json's "quantization" says, exactly as mlx-lm's
loader would). Each SwitchGLU/SwitchMLP that the manifest lists is swapped for a
StreamingExperts whose parameters are the ring's views.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from smoe.compute.streaming import (
    RouterTap,
    SlotSource,
    StreamingExperts,
    Tracer,
    ring_modules,
)
from smoe.errors import VaultError
from smoe.io.ring import ExpertRing
from smoe.topology import model_classes
from smoe.vault.format import Vault


def _quantize_like_mlx_lm(
    model: nn.Module, config: dict[str, Any], weights: dict[str, Any]
) -> None:
    """mlx-lm's load_model quantization step (mlx_lm/utils.py), for a vault's config."""
    from mlx_lm.utils import infer_quant_config

    q = config.get("quantization")
    if not q:
        return

    def predicate(path: str, module: nn.Module) -> Any:
        if path in q:
            return q[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, module, weights)

    nn.quantize(
        model,
        group_size=q["group_size"],
        bits=q["bits"],
        mode=q.get("mode", "affine"),
        class_predicate=predicate,
    )


def _resolve(root: nn.Module, path: str) -> tuple[Any, str]:
    """(parent module, attribute) of a dotted module path like 'model.layers.3.mlp.switch_mlp'."""
    parts = path.split(".")
    parent: Any = root
    for part in parts[:-1]:
        parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
    return parent, parts[-1]


def _tap_router(block: Any, layer: int, num_experts: int, tracer: Tracer) -> None:
    """Wrap the block's router (the Linear beside the experts with one output per expert)
    so the routing archive can record the full gate ranking, not only the top-k."""
    for name, child in list(block.children().items()):
        weight = getattr(child, "weight", None)
        if (
            isinstance(child, nn.Module)
            and weight is not None
            and weight.ndim == 2
            and weight.shape[0] == num_experts
            and not isinstance(child, StreamingExperts)
        ):
            setattr(block, name, RouterTap(child, layer, tracer))
            tracer.routers[layer] = child
            return


def build_model(
    vault: Vault,
    ring: ExpertRing,
    source: SlotSource,
    compute_dtype: mx.Dtype,
    tracer: Tracer | None = None,
    overlap: bool | None = None,
) -> nn.Module:
    """mlx-lm's model for ``vault`` with streamed experts; call on the compute thread.

    Float backbone weights are cast to ``compute_dtype``; quantized ones keep their packing.
    The experts compute on the ring's arrays (in the compute dtype on a staged ring; in the
    vault's dtypes on a unified one, which the engine only uses when they agree).
    ``overlap``: compute each expert as its read completes (default: on the CPU only).
    Raises VaultError if the backbone lacks or has extra tensors.
    """
    config = vault.config()
    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = dict(mx.load(str(vault.backbone_path)))
    _quantize_like_mlx_lm(model, config, weights)

    banks = ring.banks()
    num_experts = vault.manifest.num_experts
    if overlap is None:
        overlap = mx.default_device() != mx.gpu  # see StreamingExperts.overlap
    for spec in vault.manifest.layers:
        parent, attr = _resolve(model, spec.module)
        inners = ring_modules(getattr(parent, attr), banks)
        streaming = StreamingExperts(
            inners, ring.locate, spec.layer, num_experts, source, tracer, overlap
        )
        setattr(parent, attr, streaming)

    expected = {k for k, _ in tree_flatten(model.parameters())}
    missing = sorted(expected - set(weights))
    extra = sorted(set(weights) - expected)
    if missing or extra:
        raise VaultError(
            f"{vault.backbone_path} does not match mlx-lm's '{config['model_type']}' model "
            f"(missing {missing[:3]}, unexpected {extra[:3]}); convert the model again"
        )
    _load_cast(model, weights, compute_dtype)
    if tracer is not None:  # after loading: the taps change parameter paths
        for spec in vault.manifest.layers:
            parent, _ = _resolve(model, spec.module)
            _tap_router(parent, spec.layer, num_experts, tracer)
        layers = [s.layer for s in vault.manifest.layers]
        if layers:
            tracer.first_layer = layers[0]
        tracer.next_layer = dict(zip(layers, layers[1:], strict=False))
        tracer.num_experts = num_experts
    return model


def resident_model(vault: Vault, compute_dtype: mx.Dtype) -> nn.Module:
    """mlx-lm's model for ``vault`` with every weight in memory, experts included (read
    back from the records): the in-memory reference benchmarks compare the engine with.
    Float weights other than quantization scales/biases are cast to ``compute_dtype``, as
    ``build_model`` casts the backbone. Needs memory for the whole model."""
    from smoe.vault.export import read_layer

    config = vault.config()
    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = dict(mx.load(str(vault.backbone_path)))
    for spec in vault.manifest.layers:
        for name, a in read_layer(vault, spec.layer).items():
            weights[f"{spec.module}.{name}"] = a
    _quantize_like_mlx_lm(model, config, weights)
    _load_cast(model, weights, compute_dtype)
    return model


def _load_cast(model: nn.Module, weights: dict[str, Any], compute_dtype: mx.Dtype) -> None:
    """Load ``weights`` (strict), float ones other than quantization scales/biases cast to
    ``compute_dtype``; evaluate them and put the model in inference mode."""
    for name, a in weights.items():
        if mx.issubdtype(a.dtype, mx.floating) and not name.endswith((".scales", ".biases")):
            weights[name] = a.astype(compute_dtype)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
