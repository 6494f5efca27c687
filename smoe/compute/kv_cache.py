"""mlx-lm's KV caches as the runner checks and copies them: whether a model's caches can be
quantized (--kv-bits), and an independent copy of a sequence's cache (Runner.copy)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from smoe.errors import SmoeError


def check_quantizable(cache: list[Any]) -> None:
    """SmoeError unless every layer keeps a full KV cache, the kind mlx-lm quantizes."""
    kinds = sorted({type(c).__name__ for c in cache if type(c) is not KVCache})
    if kinds:
        raise SmoeError(
            f"--kv-bits needs a model whose layers all keep a full KV cache; this one has "
            f"{', '.join(kinds)} layers (sliding windows or recurrent state), which mlx-lm "
            "cannot quantize: leave --kv-bits out"
        )


def copy_cache_into(cache: list[Any], source: list[Any]) -> None:
    """Fill ``cache`` (empty, one entry per layer) with ``source``'s contents as new arrays
    of the same bits (``own``), evaluated: the two may then be written apart. A layer of
    another kind than ``source``'s (e.g. quantized) is replaced by an empty one of its."""
    for i, (mine, theirs) in enumerate(zip(cache, source, strict=True)):
        if type(mine) is not type(theirs):  # e.g. a quantized cache under kv_bits None
            mine = cache[i] = empty_like(theirs)
        if not theirs.empty():
            mine.state = own(theirs.state)
            if hasattr(theirs, "meta_state"):
                mine.meta_state = theirs.meta_state
    mx.eval([c.state for c in cache if not c.empty()])


def own(state: Any) -> Any:
    """``state`` (a cache's arrays, nested in tuples) as new arrays of the same bits. mlx-lm's
    caches write in place (``keys[..., i:j, :] = k`` replaces the array's contents for every
    holder of that array), and its KVCache's ``state`` is its arrays themselves: a copy
    holding them would write into the original's cache, and the original into its."""
    if isinstance(state, (tuple, list)):
        return type(state)(own(x) for x in state)
    return mx.contiguous(state) if isinstance(state, mx.array) else state


def empty_like(cache: Any) -> Any:
    """An empty cache of ``cache``'s kind (a quantized one keeps its group size and bits)."""
    if isinstance(cache, QuantizedKVCache):
        return QuantizedKVCache(group_size=cache.group_size, bits=cache.bits)
    return type(cache)()
