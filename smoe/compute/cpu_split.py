"""Large CPU calls split by rows over the cores, with every row's bits unchanged.

MLX's CPU kernels use one core each, and MLX runs each stream's ops on a thread of its
own. So a call of many token rows (a prefill chunk) is split into one share of rows per
stream, and the shares' outputs are joined in order. On the CPU a row's result does not
depend on the other rows of its call (the batched == solo tests; tests/exact/
test_cpu_split.py at the models' real shapes), so the output is the whole call's, bit for
bit, and equal to mlx-lm's unsplit run of the same weights.

- ``split_rows(fn, x)``: ``fn`` over ``x``'s rows in shares (any row-wise ``fn``).
- ``RowSplitLinear`` / ``install_row_split``: the backbone's linear layers (attention
  projections, dense and shared-expert MLPs, the LM head) split this way: the quantized
  ones, and the float ones under MLX's bundled reference BLAS.
  The routed experts are split by ``switch.split_call``.
Used on the CPU only: on a GPU a row's bits depend on its call's shape (solo_rows.py).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

# A call on the CPU from this many (token) rows up is split over the cores (measured:
# bench/cpu_expert_matmul.py, 1.99x on 2 cores for the experts, bits unchanged).
CPU_SPLIT_FROM = 32
_local = threading.local()  # MLX streams belong to the thread that made them


def cpu_streams() -> list[Any]:
    """One MLX CPU stream per core (at most 8), made once per thread."""
    streams: list[Any] | None = getattr(_local, "cpu_streams", None)
    if streams is None:
        n = max(1, min(os.cpu_count() or 1, 8))
        streams = _local.cpu_streams = [mx.new_stream(mx.cpu) for _ in range(n)]
    return streams


def share_bounds(rows: int) -> list[int] | None:
    """Where ``rows`` rows are cut into per-stream shares (of at least half the split
    threshold each), or None where the call is not split (small, one core, or not on
    the CPU)."""
    streams = cpu_streams()
    if rows < CPU_SPLIT_FROM or len(streams) < 2 or mx.default_device() != mx.cpu:
        return None
    shares = min(len(streams), rows // (CPU_SPLIT_FROM // 2))
    return [rows * i // shares for i in range(shares + 1)]


def split_rows(fn: Callable[[mx.array], mx.array], x: mx.array) -> mx.array:
    """``fn(x)`` for a row-wise ``fn``, its rows split over the CPU's cores where
    ``share_bounds`` says so. x: [..., D] -> [..., F] (lazy)."""
    rows = 1
    for n in x.shape[:-1]:
        rows *= n
    bounds = share_bounds(rows)
    if bounds is None:
        return fn(x)
    flat = x.reshape(rows, x.shape[-1])  # [R, D]
    outs = []
    for stream, lo, hi in zip(cpu_streams(), bounds, bounds[1:], strict=False):
        with mx.stream(stream):
            outs.append(fn(flat[lo:hi]))  # [r, F]
    return mx.concatenate(outs, axis=0).reshape(*x.shape[:-1], -1)


class RowSplitLinear(nn.Module):  # type: ignore[misc, name-defined]  # mlx.nn: untyped
    """A linear layer whose large calls are split by rows over the CPU's cores."""

    def __init__(self, inner: Callable[[mx.array], mx.array]) -> None:
        super().__init__()
        self.inner = inner

    def __call__(self, x: mx.array) -> mx.array:
        return split_rows(self.inner, x)


def install_row_split(model: Any, skip: Callable[[str, Any], bool], floats: bool) -> int:
    """Wrap the linear layers of ``model`` in ``RowSplitLinear`` unless ``skip(path,
    parent)``: the quantized ones (MLX's own kernel), and with ``floats`` the float ones
    too. Call after the weights are loaded (the wrap changes parameter paths). Returns
    how many were wrapped.

    ``floats``: only under MLX's bundled reference BLAS (smoe.util.blas), whose matmul
    computes each row alone (measured 1.9x on two cores, bits equal); an optimized BLAS
    picks its kernels by the row count, so a split would change the bits, and it uses
    the cores already."""
    kinds: tuple[type, ...] = (nn.QuantizedLinear,)  # type: ignore[attr-defined]  # mlx.nn: untyped
    if floats:
        kinds += (nn.Linear,)  # type: ignore[attr-defined]
    found: list[tuple[str, Any]] = [
        (path, m) for path, m in model.named_modules() if isinstance(m, kinds)
    ]
    wrapped = 0
    for path, module in found:
        parent: Any = model
        parts = path.split(".")
        for part in parts[:-1]:
            parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
        if skip(path, parent):
            continue
        if parts[-1].isdigit():
            parent[int(parts[-1])] = RowSplitLinear(module)
        else:
            setattr(parent, parts[-1], RowSplitLinear(module))
        wrapped += 1
    return wrapped
