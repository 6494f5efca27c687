"""Build mlx-lm's model for a vault: the backbone resident, the routed experts streamed.

The model class is mlx-lm's own for the vault's model_type. Its backbone weights come from
backbone.safetensors (quantized as config.json's "quantization" says, exactly as mlx-lm's
loader would). Each SwitchGLU/SwitchMLP that the manifest lists is swapped for a
StreamingExperts whose parameters are the ring's views.
"""

from __future__ import annotations

import functools
import inspect
from collections import ChainMap
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from smoe.compute.sharded import ExpertShard
from smoe.compute.solo_rows import KernelRules
from smoe.compute.speculation import RouterTap
from smoe.compute.streaming import SlotSource, StreamingExperts
from smoe.compute.switch import ring_modules
from smoe.compute.tracing import Tracer
from smoe.errors import SmoeError, VaultError
from smoe.io.ring import ExpertRing
from smoe.models.dtypes import FloatPolicy, describe_exceptions, header_dtypes
from smoe.models.dtypes import float_policy as dtype_policy
from smoe.models.topology import model_classes
from smoe.vault.format import Vault
from smoe.vault.source import Source


@dataclass(frozen=True)
class _TensorShape:
    """A tensor's shape and dtype without its data: all mlx-lm's inference reads of it."""

    shape: tuple[int, ...]
    dtype: Any


def record_tensors(vault: Vault) -> dict[str, _TensorShape]:
    """Each streamed expert tensor, named as mlx-lm names it ('<module>.<component>'), with
    its stacked shape [E, ...] and dtype, read from the manifest (no record is read)."""
    from smoe.io.ring import mx_dtype

    m = vault.manifest
    return {
        f"{spec.module}.{c.name}": _TensorShape((m.num_experts, *c.shape), mx_dtype(c.dtype))
        for spec in m.layers
        for c in m.record.components
    }


def _quantize_like_mlx_lm(model: nn.Module, config: dict[str, Any], weights: Any) -> None:
    """mlx-lm's load_model quantization step (mlx_lm/utils.py), for a vault's config.

    ``weights`` must name every tensor of the model, experts included (their records'
    shapes suffice): as in mlx-lm, a module not named in the config's per-path entries is
    quantized iff it has ``.scales``, with the packing its shapes imply. mlx-lm's own
    converter writes no per-path entries for uniform quantization, so the experts' packing
    is known only from their records.
    """
    from mlx_lm.utils import infer_quant_config

    q = config.get("quantization")
    if not q:
        return

    def predicate(path: str, module: nn.Module) -> Any:
        if path in q:
            return q[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        params = infer_quant_config(path, module, weights)
        if f"{path}.global_scale" in weights and _takes_global_scale(module):
            params["global_scale"] = True  # mlx-lm's loader does the same (nvfp4 experts)
        return params

    nn.quantize(
        model,
        group_size=q["group_size"],
        bits=q["bits"],
        mode=q.get("mode", "affine"),
        class_predicate=predicate,
    )


def float_policy(vault: Vault, compute_dtype: Any) -> FloatPolicy:
    """Which dtype each of ``vault``'s float tensors is kept in at ``compute_dtype``
    (smoe.models.dtypes: the weights' own dtype follows the compute dtype, a tensor stored
    wider, such as a float32 router, keeps its width, as mlx-lm's loaded model does)."""
    return dtype_policy(
        _dtype_name(compute_dtype),
        [c.dtype for c in vault.manifest.record.components],
        vault.backbone_header(),
        vault.config(),
    )


def _dtype_name(dtype: Any) -> str:
    return str(dtype).split(".")[-1]


def compute_dtype_note(vault: Vault, dtype: Any, requested: bool) -> str:
    """The compute dtype and why, for exactness claims: mlx-lm runs a model in its weights'
    dtypes, and the engine equals it only computing in that same dtype. e.g. 'float32 (the
    CPU's fast dtype; the weights are bfloat16: --dtype bfloat16 computes as mlx-lm runs
    them)', or 'bfloat16 (the weights' dtype, as mlx-lm runs them; mlp.gate.weight float32
    as stored)': the tensors kept out of the compute dtype are named."""
    name = _dtype_name(dtype)
    if requested:
        origin = "as asked"
    else:  # the engine's defaults: float32 kernels are the fast ones on a CPU
        origin = "the CPU's fast dtype" if name == "float32" else "the GPU default"
    policy = float_policy(vault, dtype)
    stored = {n: d for n, (d, _) in header_dtypes(vault.backbone_header()).items()}
    kept = describe_exceptions(policy.exceptions(stored))
    own = policy.weights
    if own is None or own == name:
        why = "the weights' dtype, as mlx-lm runs them" if own == name else origin
        return f"{name} ({why}; {kept} as stored)" if kept else f"{name} ({why})"
    kept = f"; {kept} as stored" if kept else ""
    if _has_float_experts(vault) and not _gather_mm_works(getattr(mx, own)):
        return (
            f"{name} (the weights are {own}, but MLX multiplies float experts in {name} here{kept})"
        )
    return f"{name} ({origin}; the weights are {own}: --dtype {own} computes as mlx-lm runs them{kept})"


def _has_float_experts(vault: Vault) -> bool:
    names = {c.name for c in vault.manifest.record.components}
    return any(n.endswith(".weight") and n[: -len("weight")] + "scales" not in names for n in names)


def _gather_mm_works(dtype: mx.Dtype) -> bool:
    """Whether MLX multiplies float experts in ``dtype`` on the default device (its CPU
    gather_mm is float32 only in 0.32, so mlx-lm cannot run them in bf16 there either)."""
    a, b = mx.zeros((1, 1, 2), dtype), mx.zeros((1, 2, 2), dtype)
    try:
        mx.eval(mx.gather_mm(a, b, rhs_indices=mx.array([0], dtype=mx.uint32)))
    except RuntimeError:
        return False
    return True


def _check_float_experts(vault: Vault, compute_dtype: mx.Dtype) -> None:
    if _has_float_experts(vault) and not _gather_mm_works(compute_dtype):
        name = str(compute_dtype).split(".")[-1]
        where = "the CPU" if mx.default_device() == mx.cpu else "this GPU"
        raise SmoeError(
            f"this vault's experts are float (unquantized) and MLX cannot multiply them in "
            f"{name} on {where}: use --dtype float32, or a quantized vault "
            "(smoe convert SRC VAULT --bits 4)"
        )


def _takes_global_scale(module: nn.Module) -> bool:
    """Whether the quantized form holds an nvfp4 tensor scale (mlx_lm.utils' private rule)."""
    return "global_scale" in inspect.signature(module.to_quantized).parameters


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


def _model_of(vault: Vault, config: dict[str, Any]) -> nn.Module:
    """mlx-lm's model object for ``config``. A config mlx-lm cannot build from (a key its
    ModelArgs needs is missing or mistyped, in a vault whose config is not checksummed) is
    a VaultError naming the file, not mlx-lm's traceback."""
    model_class, args_class = model_classes(config)
    try:
        return model_class(args_class.from_dict(config))
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise VaultError(
            f"{vault.config_path} does not describe a model mlx-lm can build "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r}); "
            "convert the model again"
        ) from None


def build_model(
    vault: Vault,
    ring: ExpertRing,
    source: SlotSource,
    compute_dtype: mx.Dtype,
    tracer: Tracer | None = None,
    overlap: bool | None = None,
    shards: dict[int, ExpertShard] | None = None,
    rules: KernelRules | None = None,
) -> nn.Module:
    """mlx-lm's model for ``vault`` with streamed experts; call on the compute thread.

    Float backbone tensors, quantization scales/biases included, are kept in the dtype
    ``float_policy`` gives them: the weights' own dtype cast to ``compute_dtype`` (mlx-lm's
    ``model.set_dtype``), a tensor stored wider (a float32 router) as stored; packed
    weights stay as they are.
    The experts compute on the ring's arrays (in the compute dtype on a staged ring; in the
    vault's dtypes on a unified one, which the engine only uses when they agree).
    ``overlap``: compute each expert as its read completes (default: on the CPU only).
    ``shards``: per MoE layer, this rank's experts and the sum over ranks (expert
    parallelism, compute/sharded.py); None: this process computes every expert.
    ``rules``: the device's kernel rules; each expert call (or part of one) is shaped so
    its rows get the reference call's kernel (compute/solo_rows.py); None: the CPU.
    Raises VaultError if the backbone lacks or has extra tensors.
    """
    _check_float_experts(vault, compute_dtype)
    config = vault.config()
    model = _model_of(vault, config)
    weights = backbone_weights(vault)
    _quantize_like_mlx_lm(model, config, ChainMap(weights, record_tensors(vault)))

    banks = ring.banks()
    num_experts = vault.manifest.num_experts
    if overlap is None:
        overlap = mx.default_device() != mx.gpu  # see StreamingExperts.overlap
    for spec in vault.manifest.layers:
        parent, attr = _resolve(model, spec.module)
        try:
            inners = ring_modules(getattr(parent, attr), banks)
        except ValueError as e:  # a vault no converter of ours writes
            raise VaultError(f"{vault.path}: {e}; convert the model again") from None
        shard = None if shards is None else shards[spec.layer]
        streaming = StreamingExperts(
            inners, ring.locate, spec.layer, num_experts, source, tracer, overlap, shard, rules
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
    _load_cast(model, weights, float_policy(vault, compute_dtype))
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


def moe_routers(model: nn.Module, vault: Vault) -> list[nn.Module]:
    """Each MoE block's router (the module beside the streamed experts holding one weight
    row per expert, inside its RouterTap if tapped) that is not a Linear: DeepSeek's
    MoEGate and the like, row-wise modules whose matmul needs row pieces too."""
    found = []
    for spec in vault.manifest.layers:
        block, _ = _resolve(model, spec.module)
        for child in block.children().values():
            target = child.router if isinstance(child, RouterTap) else child
            weight = target.get("weight") if isinstance(target, nn.Module) else None
            if (
                isinstance(weight, mx.array)
                and weight.ndim == 2
                and weight.shape[0] == vault.manifest.num_experts
                and not isinstance(target, nn.Linear | nn.QuantizedLinear | StreamingExperts)
            ):
                found.append(target)
    return found


def resident_model(vault: Vault, compute_dtype: mx.Dtype) -> nn.Module:
    """mlx-lm's model for ``vault`` with every weight in memory, experts included (read
    back from the records): the in-memory reference benchmarks compare the engine with.
    Float tensors are kept as ``build_model`` keeps the backbone's (``float_policy``).
    Needs memory for the whole model."""
    from smoe.vault.export import read_layer

    config = vault.config()
    model = _model_of(vault, config)
    weights = backbone_weights(vault)
    for spec in vault.manifest.layers:
        for name, a in read_layer(vault, spec.layer).items():
            weights[f"{spec.module}.{name}"] = a
    _quantize_like_mlx_lm(model, config, weights)
    _load_cast(model, weights, float_policy(vault, compute_dtype))
    return model


@functools.singledispatch
def backbone_weights(vault: Vault) -> dict[str, Any]:
    """The backbone's tensors, lazily: a vault's backbone.safetensors, or a download's
    shards through mlx-lm's loader (chosen by the model's type)."""
    return dict(mx.load(str(vault.backbone_path)))


@backbone_weights.register
def _(vault: Source) -> dict[str, Any]:
    from smoe.compute.source_backbone import source_backbone

    return source_backbone(vault)


def _load_cast(model: nn.Module, weights: dict[str, Any], policy: FloatPolicy) -> None:
    """Load ``weights`` (strict), each float one in the dtype ``policy`` keeps it in:
    the weights' own dtype cast to the compute dtype as mlx-lm's ``model.set_dtype`` does,
    scales and biases included (kept bf16, a quantized embedding would dequantize in bf16
    under float32 compute, and each call would convert them); a tensor stored wider (a
    float32 router) keeps its width. Evaluate them and put the model in inference mode."""
    for name, a in weights.items():
        if mx.issubdtype(a.dtype, mx.floating):
            kept = getattr(mx, policy.kept(name, _dtype_name(a.dtype)))
            if kept != a.dtype:
                weights[name] = a.astype(kept)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
