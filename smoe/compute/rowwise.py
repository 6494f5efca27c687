"""Batched decode for sequences of different lengths, exactly as if each ran alone.

A decode step of B sequences runs the model once on [B, 1] tokens. Everything but
attention is row-wise arithmetic (embeddings, norms, projections, routers, the streamed
experts, the LM head), so it runs batched: one read of each expert serves every sequence
that routes to it. Attention is the one place where sequences differ in length; there
only the parts that touch a row's own cache run per row: RoPE at the row's offset, the
cache update, and scaled dot-product attention against the row's keys (the call each
row makes alone). The projections and norms around them stay batched, one call for all
rows (on a GPU shaped by ``solo_rows``), so a row adds five small kernels per layer, not
the whole module. No padding, no merged cache, and a row's arithmetic is the solo
arithmetic wherever the kernels compute rows independently (tests/exact/test_batching.py
checks this bit for bit).

The model is handed, per layer, a ``RowCaches`` (the B sequences' caches of that layer)
instead of one cache; masks it builds from it come back as ``RowMasks``. mlx-lm's
attention reads ``cache.offset`` for RoPE, calls ``cache.update_and_fetch`` and passes the
result to its module's ``scaled_dot_product_attention``: ``RowCaches`` answers the first
two per row, and ``route_attention_per_row`` makes the third split its rows again.
An architecture whose attention does not follow that pattern runs its whole attention
module once per row (``RowwiseAttention(batched=False)``).

A verify pass (drafts) runs one sequence's L tokens at once. Where kernels round a
several-row attention otherwise than one row (a GPU, docs/gpu.md), it is handed a
``RowSequence`` per layer instead: the attention then runs the L rows one after another,
each appending its keys and values to the cache first, as L decode steps would.
"""

from __future__ import annotations

import sys
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


class RowOffsets:
    """Each row's cache offset, where mlx-lm's attention reads ``cache.offset`` (for RoPE)."""

    def __init__(self, offsets: list[Any]) -> None:
        self.offsets = offsets


class RowKeys:
    """Each row's keys (or values) as its own cache returned them: [1, H, L_i, D] each."""

    def __init__(self, rows: list[Any]) -> None:
        self.rows = rows


class RowCaches:
    """The B sequences' caches of one layer, passed where the model expects one cache.

    Inside a batched attention call it also stands for the rows' caches one by one:
    ``offset`` gives each row's, ``update_and_fetch`` appends row i's keys and values to
    cache i and returns every row's keys and values as ``RowKeys``."""

    def __init__(self, caches: list[Any]) -> None:
        self.caches = caches

    def __bool__(self) -> bool:  # mlx-lm tests ``if cache`` before ``cache.make_mask``
        return True

    def make_mask(self, n: int, **kwargs: Any) -> RowMasks:
        return RowMasks([c.make_mask(n, **kwargs) for c in self.caches])

    @property
    def offset(self) -> RowOffsets:
        return RowOffsets([c.offset for c in self.caches])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[RowKeys, RowKeys]:
        """keys, values: [B, H, 1, D] -> row i's cache's keys and values, [1, H, L_i, D]."""
        rows = zip(_rows(keys), _rows(values), strict=True)
        fetched = [c.update_and_fetch(k, v) for c, (k, v) in zip(self.caches, rows, strict=True)]
        return RowKeys([k for k, _ in fetched]), RowKeys([v for _, v in fetched])


class RowRope(nn.Module):
    """A RoPE module that applies each row's own offset when given ``RowOffsets``: one
    call with the offsets as an array, which MLX's kernel reads per row (the probe
    bench/gpu/row_fingerprint.py finds each row's bits equal to its call alone); otherwise
    the wrapped RoPE unchanged."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if not isinstance(offset, RowOffsets):
            return self.inner(x, offset)  # type: ignore[no-any-return]
        return self.inner(x, mx.array(offset.offsets))  # type: ignore[no-any-return]  # x: [B, H, 1, D]


def _rows(x: mx.array) -> list[mx.array]:
    """x: [B, ...] -> B arrays [1, ...], in one primitive (a slice per row would be B)."""
    return mx.split(x, x.shape[0], axis=0) if x.shape[0] > 1 else [x]


def _attention_per_row(sdpa: Any) -> Any:
    """``sdpa`` (mlx-lm's ``scaled_dot_product_attention``), made to run one call per row
    when its keys come from a ``RowCaches``: row i's queries against cache i's keys, with
    row i's mask, as in row i's solo step. Any other call is ``sdpa`` unchanged."""

    def per_row(
        queries: mx.array, keys: Any, values: Any, cache: Any, scale: float, mask: Any, **kw: Any
    ) -> mx.array:
        if not isinstance(cache, RowCaches):
            return sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)  # type: ignore[no-any-return]
        # queries: [B, Hq, 1, D]; keys.rows[i], values.rows[i]: [1, Hkv, L_i, D]
        outs = [
            sdpa(
                q,
                keys.rows[i],
                values.rows[i],
                cache=c,
                scale=scale,
                mask=mask.masks[i] if isinstance(mask, RowMasks) else mask,
                **kw,
            )
            for i, (c, q) in enumerate(zip(cache.caches, _rows(queries), strict=True))
        ]
        return mx.concatenate(outs, axis=0)

    per_row.routes_rows = True  # type: ignore[attr-defined]
    return per_row


def route_attention_per_row(attention: nn.Module) -> bool:
    """Make the module that defines ``attention``'s class call its attention per row for
    a ``RowCaches`` (``_attention_per_row``); True if it could. mlx-lm's attention modules
    call the name ``scaled_dot_product_attention`` of their own module, so that name is
    where rows can be split without copying the module's code; every other caller of it
    (a lone sequence, mlx-lm's own models in the tests) gets the function unchanged."""
    from mlx_lm.models import base

    module = sys.modules.get(type(attention).__module__)
    current = getattr(module, "scaled_dot_product_attention", None)
    if getattr(current, "routes_rows", False):
        return True
    if current is not base.scaled_dot_product_attention:
        return False
    module.scaled_dot_product_attention = _attention_per_row(current)
    return True


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
    """Runs the wrapped attention row by row where rows have their own caches: given
    ``RowCaches`` (a batch, each row with its own cache) it runs once on all rows with
    only RoPE, the cache update and the attention itself per row when ``batched`` (see
    the module's docstring), else the whole module once per row; given a ``RowSequence``
    (one sequence's rows in turn, on its cache) the whole module once per row. Otherwise
    (one sequence, prefill, tests) it is the wrapped module unchanged."""

    def __init__(self, inner: nn.Module, batched: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.batched = batched

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        sequence = _find(args, kwargs, RowSequence)
        if sequence is not None:
            return self._in_turn(x, sequence, args, kwargs)
        rows = _find(args, kwargs, RowCaches)
        if rows is None or self.batched:
            return self.inner(x, *args, **kwargs)  # type: ignore[no-any-return]
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
        attention = getattr(layer, name)
        batched = arch.batched_attention and _batch(attention)
        setattr(layer, name, RowwiseAttention(attention, batched))
    return True


def _batch(attention: nn.Module) -> bool:
    """Prepare ``attention`` to run a batch in one call, its rows' RoPE, cache update and
    attention one row per call; False (it then runs once per row) where its module does
    not follow mlx-lm's pattern: a ``rope`` module and the module's attention function."""
    rope = getattr(attention, "rope", None)
    if not isinstance(rope, nn.Module) or not route_attention_per_row(attention):
        return False
    if not isinstance(rope, RowRope):
        attention.rope = RowRope(rope)
    return True
