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

A verify pass (drafts) runs one sequence's L tokens at once. Where kernels round a
several-row attention otherwise than one row (a GPU, docs/gpu.md), it is handed a
``RowSequence`` per layer instead: the attention then runs the L rows one after another,
each appending its keys and values to the cache first, as L decode steps would.
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


class SequenceMask:
    """Stands for the masks of a ``RowSequence``'s rows: each is made when its row runs
    (a one-token step's mask at the cache's offset then), with these options."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options


class RowSequence:
    """One sequence's cache of one layer, passed where the model expects the cache, for a
    pass whose query rows must each be computed as its own decode step."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def __bool__(self) -> bool:  # mlx-lm tests ``if cache`` before ``cache.make_mask``
        return True

    def make_mask(self, n: int, **kwargs: Any) -> SequenceMask:
        return SequenceMask(kwargs)


class RowwiseAttention(nn.Module):
    """Runs the wrapped attention once per row when given ``RowCaches`` (a batch: each
    row with its own cache) or a ``RowSequence`` (one sequence's rows in turn, on its
    cache); otherwise (one sequence, prefill, tests) it is the wrapped module unchanged."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        sequence = _find(args, kwargs, RowSequence)
        if sequence is not None:
            return self._in_turn(x, sequence, args, kwargs)
        rows = _find(args, kwargs, RowCaches)
        if rows is None:
            return self.inner(x, *args, **kwargs)
        # x: [B, 1, D] -> B calls on [1, 1, D], each with its own cache and mask
        outs = []
        for i, cache in enumerate(rows.caches):
            row_args = [_pick(a, i, cache) for a in args]
            row_kwargs = {k: _pick(v, i, cache) for k, v in kwargs.items()}
            outs.append(self.inner(x[i : i + 1], *row_args, **row_kwargs))
        return mx.concatenate(outs, axis=0)

    def _in_turn(
        self, x: mx.array, sequence: RowSequence, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> mx.array:
        """x: [1, L, D] -> L calls on [1, 1, D], row j after rows < j are in the cache."""
        cache = sequence.cache
        outs = []
        for j in range(x.shape[1]):

            def pick(value: Any) -> Any:
                if isinstance(value, RowSequence):
                    return cache
                if isinstance(value, SequenceMask):
                    return cache.make_mask(1, **value.options)
                return value

            row_args = [pick(a) for a in args]
            row_kwargs = {k: pick(v) for k, v in kwargs.items()}
            outs.append(self.inner(x[:, j : j + 1], *row_args, **row_kwargs))
        return mx.concatenate(outs, axis=1)


def _find(args: tuple[Any, ...], kwargs: dict[str, Any], kind: type) -> Any:
    for a in (*args, *kwargs.values()):
        if isinstance(a, kind):
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
