"""The backbone of a checkpoint folder (a ``Source``), straight from its shards.

A vault's backbone.safetensors is what ``smoe convert`` keeps of mlx-lm's lazily loaded
model once the experts are taken out (``ConversionPlan.backbone_tensors``, with no cast
for ``--bits 16`` or an MLX source). A source gets the same tensors the same way: mlx-lm's
``load_model(lazy=True)`` through ``open_checkpoint`` (its sanitize, its quantization, its
strict name and shape checks), every expert module's parameters left out. Nothing is read
until the engine evaluates the backbone; the experts' lazy arrays are dropped unread.

It also checks that mlx-lm sees the experts where and as the index does: the same modules,
components, shapes and dtypes. A sanitize step the index does not know of would show
there, and is refused naming ``smoe convert``.
"""

from __future__ import annotations

from typing import Any

from smoe.errors import UnsupportedModelError
from smoe.vault.source import Source
from smoe.vault.source_index import CONVERT


def source_backbone(source: Source) -> dict[str, Any]:
    """{mlx-lm name: lazy mx.array} of every non-expert parameter of ``source``. Raises
    CheckpointError (from mlx-lm's checks) or UnsupportedModelError naming the fix."""
    from smoe.models.checkpoint import open_checkpoint

    ck = open_checkpoint(source.path)
    _check_experts_as_indexed(source, ck)
    prefixes = tuple(m.path + "." for m in ck.experts)
    backbone = {k: a for k, a in ck.params.items() if not k.startswith(prefixes)}
    ck.params.clear()
    ck.model = None
    return backbone


def _check_experts_as_indexed(source: Source, ck: Any) -> None:
    m = source.manifest
    got_layers = [(e.layer, e.path) for e in ck.experts]
    want_layers = [(s.layer, s.module) for s in m.layers]
    problem = None
    if got_layers != want_layers:
        problem = f"its expert modules are {got_layers[:2]}..., the index's {want_layers[:2]}..."
    else:
        want = {c.name: (c.shape, c.dtype) for c in m.record.components}
        for spec in m.layers:
            prefix = spec.module + "."
            got = {
                k[len(prefix) :]: (tuple(a.shape[1:]), str(a.dtype).split(".")[-1])
                for k, a in ck.params.items()
                if k.startswith(prefix)
            }
            counts = {a.shape[0] for k, a in ck.params.items() if k.startswith(prefix)}
            if got != want or counts != {m.num_experts}:
                problem = f"{spec.module} holds {sorted(got.items())[:3]}, the index {sorted(want.items())[:3]}"
                break
    if problem is not None:
        raise UnsupportedModelError(
            f"{source.path}: mlx-lm reads the experts otherwise than S-MoE indexes them in "
            f"the shards ({problem}); {CONVERT}"
        )
