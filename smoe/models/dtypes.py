"""Which dtype each float tensor of a model is kept (and so computed) in.

mlx-lm's ``load_model`` casts nothing: each tensor runs in the dtype its file stores it
in. Real checkpoints mix dtypes on purpose (DeepSeek's and transformers' routers and
``e_score_correction_bias`` in float32 beside bfloat16 weights), and mlx-lm's matmul of a
bfloat16 activation with a float32 router computes in float32. The engine computes in
one dtype of its own (float32 on a CPU, bfloat16 on a GPU, or ``--dtype``), so it must
say which tensors follow that dtype and which keep theirs. The rule (``FloatPolicy``):

- a tensor in the weights' own dtype follows the compute dtype, as mlx-lm's
  ``model.set_dtype`` and ``mlx_lm.convert --dtype`` cast it, except where the model's
  ``cast_predicate`` says mlx-lm never casts it (its convert keeps those as they are);
- a tensor stored in another float dtype (a float32 router in a bfloat16 checkpoint), or
  one mlx-lm never casts, keeps the wider of its own dtype and the compute dtype.

So at the weights' own dtype every tensor keeps its stored dtype: the engine is mlx-lm's
loaded model, bit for bit. At a wider compute dtype (float32 on a CPU) every tensor is
widened, as ``model.set_dtype(mx.float32)`` would. Names are dtype names ('bfloat16');
this module needs no MLX (smoe.plan sizes the backbone with it).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

FLOAT_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
SAFETENSORS_FLOATS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _cast_all(_name: str) -> bool:
    return True


@dataclass(frozen=True)
class FloatPolicy:
    """The dtype each float tensor is kept in, for one model at one compute dtype."""

    compute: str  # the engine's compute dtype, e.g. 'bfloat16'
    weights: str | None  # the checkpoint's own float dtype (``weights_dtype``); None: no floats
    castable: Callable[[str], bool] = _cast_all  # mlx-lm's cast_predicate(name)

    def kept(self, name: str, stored: str) -> str:
        """The dtype tensor ``name``, stored as ``stored``, is kept in (a dtype name);
        a non-float dtype is kept as it is."""
        if stored not in FLOAT_SIZES:
            return stored
        if stored == self.weights and self.castable(name):
            return self.compute
        return wider(stored, self.compute)

    def exceptions(self, stored: Mapping[str, str]) -> dict[str, str]:
        """{name: kept dtype} of the float tensors not kept in the compute dtype."""
        out = {}
        for name, dtype in stored.items():
            kept = self.kept(name, dtype)
            if kept in FLOAT_SIZES and kept != self.compute:
                out[name] = kept
        return out


def wider(a: str, b: str) -> str:
    """The wider of two float dtypes; ``a`` where they are as wide."""
    return b if FLOAT_SIZES[b] > FLOAT_SIZES[a] else a


def weights_dtype(
    record_floats: Iterable[str], backbone: Mapping[str, tuple[str, int]]
) -> str | None:
    """The checkpoint's own float dtype: its experts' (the records' float components: one
    dtype, the converter writes them so), else the dtype that holds most of the backbone's
    float elements. ``backbone``: {name: (dtype name, element count)}."""
    found = {d for d in record_floats if d in FLOAT_SIZES}
    if len(found) == 1:
        return found.pop()
    counts: Counter[str] = Counter()
    for dtype, count in backbone.values():
        if dtype in FLOAT_SIZES:
            counts[dtype] += count
    return counts.most_common(1)[0][0] if counts else None


def header_dtypes(header: Mapping[str, Any]) -> dict[str, tuple[str, int]]:
    """{name: (dtype name, element count)} of a safetensors header's tensors (safetensors'
    float names mapped to dtype names; other dtypes kept as the header spells them)."""
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_FLOATS.get(entry["dtype"], entry["dtype"])
        out[name] = (dtype, math.prod(int(n) for n in entry["shape"]))
    return out


def cast_predicate_of(model_class: type) -> Callable[[str], bool]:
    """mlx-lm's ``cast_predicate`` of a model class (a property whose closure needs no
    instance in mlx-lm's models), else one that casts every tensor, as mlx-lm's convert
    falls back to."""
    prop = getattr(model_class, "cast_predicate", None)
    if isinstance(prop, property) and prop.fget is not None:
        try:
            predicate = prop.fget(None)
        except Exception:  # a predicate that reads its instance: build the model instead
            return _cast_all
        if callable(predicate):
            return predicate  # type: ignore[no-any-return]
    return _cast_all


def float_policy(
    compute: str,
    record_floats: Iterable[str],
    header: Mapping[str, Any],
    config: Mapping[str, Any],
) -> FloatPolicy:
    """The FloatPolicy of a model at ``compute``: ``record_floats`` its records' component
    dtypes, ``header`` its backbone's safetensors header, ``config`` its config.json."""
    from smoe.models.topology import model_classes

    model_class, _ = model_classes(dict(config))
    return FloatPolicy(
        compute, weights_dtype(record_floats, header_dtypes(header)), cast_predicate_of(model_class)
    )


def describe_exceptions(exceptions: Mapping[str, str]) -> str:
    """'mlp.gate.weight, mlp.gate.e_score_correction_bias float32' for the tensors kept out
    of the compute dtype, each named once without its layer prefix, grouped by dtype."""
    by_dtype: dict[str, list[str]] = {}
    for name, dtype in exceptions.items():
        short = _without_layer(name)
        names = by_dtype.setdefault(dtype, [])
        if short not in names:
            names.append(short)
    return "; ".join(f"{', '.join(names)} {dtype}" for dtype, names in sorted(by_dtype.items()))


def _without_layer(name: str) -> str:
    """'model.layers.3.mlp.gate.weight' -> 'mlp.gate.weight' (the part after a layer index)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[i + 1 :]) or name
    return name
