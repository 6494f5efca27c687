"""Batched decode for sequences of different lengths, exactly as if each ran alone.

A decode step of B sequences runs the model once on [B, 1] tokens. Everything but
attention is row-wise arithmetic (embeddings, norms, projections, routers, the streamed
experts, the LM head), so it runs batched: one read of each expert serves every sequence
that routes to it. Attention is the one place where sequences differ in length; there
``RowwiseAttention`` runs each row against its own KV cache, the call it makes alone.
So no padding, no merged cache, and a row's arithmetic is the solo arithmetic wherever
the kernels compute rows independently (tests/test_batching.py checks this bit for bit).

The model is handed, per layer, a ``RowCaches`` (the B sequences' caches of that layer)
instead of one cache; masks it builds from it come back as ``RowMasks``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from smoe.models.registry import architecture

# The decoder layer's module that consumes the cache, by the names mlx-lm uses.
CACHE_CONSUMERS = ("self_attn", "attention", "linear_attn")


class RowMasks:
    """One attention mask per row (``None`` where a row needs none)."""

    def __init__(self, masks: list[Any]) -> None:
        self.masks = masks


class RowCaches:
    """The B sequences' caches of one layer, passed where the model expects one cache."""

    def __init__(self, caches: list[Any]) -> None:
        self.caches = caches

    def __bool__(self) -> bool:  # mlx-lm tests ``if cache`` before ``cache.make_mask``
        return True

    def make_mask(self, n: int, **kwargs: Any) -> RowMasks:
        return RowMasks([c.make_mask(n, **kwargs) for c in self.caches])


class RowwiseAttention(nn.Module):
    """Runs the wrapped attention once per row when given ``RowCaches``; otherwise (one
    sequence, prefill, tests) it is the wrapped module unchanged."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        rows = _row_caches(args, kwargs)
        if rows is None:
            return self.inner(x, *args, **kwargs)
        # x: [B, 1, D] -> B calls on [1, 1, D], each with its own cache and mask
        outs = []
        for i, cache in enumerate(rows.caches):
            row_args = [_pick(a, i, cache) for a in args]
            row_kwargs = {k: _pick(v, i, cache) for k, v in kwargs.items()}
            outs.append(self.inner(x[i : i + 1], *row_args, **row_kwargs))
        return mx.concatenate(outs, axis=0)


def _row_caches(args: tuple[Any, ...], kwargs: dict[str, Any]) -> RowCaches | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, RowCaches):
            return a
    return None


def _pick(value: Any, row: int, cache: Any) -> Any:
    if isinstance(value, RowCaches):
        return cache
    if isinstance(value, RowMasks):
        return value.masks[row]
    return value


def install_rowwise_attention(model: nn.Module, model_type: str) -> bool:
    """Wrap every decoder layer's cache consumer in ``RowwiseAttention`` (after the
    weights are loaded: parameter paths change). Returns whether batched decode is on."""
    arch = architecture(model_type)  # batched decode is tested per architecture
    if arch is None or not arch.batched_decode:
        return False
    layers = getattr(model, "layers", None)
    if not layers:
        return False
    targets = []
    for layer in layers:
        names = [n for n in CACHE_CONSUMERS if isinstance(getattr(layer, n, None), nn.Module)]
        if len(names) != 1:
            return False
        targets.append((layer, names[0]))
    for layer, name in targets:
        setattr(layer, name, RowwiseAttention(getattr(layer, name)))
    return True
