"""mlx-lm's expert modules (SwitchGLU/SwitchMLP) computing on ring banks.

- ``ring_modules``: one copy of the model's expert module per ring bank, its stacked
  parameters replaced by the bank's arrays, so it computes on slots in place;
- ``switch_call``: that module's call, optionally with rows sorted by expert as mlx-lm
  sorts a large call, so a part of such a call uses the same kernels;
- ``unsorted_call``: the same call never sorted, however many rows (each row then runs
  the per-row kernel a decode step's small call runs: smoe.compute.solo_rows);
- ``CallAssembly``: the one scatter helper, assembling a call's output from parts computed
  separately (waves, banks, experts as their reads complete) at their (token, rank)
  positions, so the block's combination is the single call's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from smoe.compute import cpu_split
from smoe.compute.native import is_native
from smoe.errors import VaultError


class CallAssembly:
    """Assembles a MoE call's output [..., k, D] from parts computed separately, each on
    the (token, rank) pairs routed to some of the experts, one row per pair. Each pair's
    row is put back at its (token, rank) position, so the block's rank-order combination
    is the single call's."""

    def __init__(self, x: mx.array, idx: np.ndarray, evaluate: bool = True) -> None:
        # N = tokens, k = ranks, D = hidden, P = (token, rank) pairs of one part
        # evaluate: each part is evaluated as it is added (waves, whose slots are released
        # after each); False leaves the assembly lazy for the caller's one evaluation.
        self.evaluate = evaluate
        self.sorted = idx.size >= SORT_FROM  # mlx-lm would make this call sorted
        self.shape = idx.shape
        self.k = idx.shape[-1]
        self.flat_idx = idx.reshape(-1, self.k)  # [N, k]
        self.flat_x = x.reshape(-1, x.shape[-1])  # [N, D]
        self.out: mx.array | None = None

    def add(self, experts: list[int], compute: Callable[[mx.array, np.ndarray], mx.array]) -> None:
        """``compute(x [P, D], idx [P, 1])`` -> [P, 1, D] for the pairs routed to ``experts``."""
        rows, ranks = np.nonzero(np.isin(self.flat_idx, experts))  # [P], [P]
        y = compute(self.flat_x[mx.array(rows)], self.flat_idx[rows, ranks][:, None])
        if self.out is None:
            self.out = mx.zeros((self.flat_idx.shape[0], self.k, y.shape[-1]), dtype=y.dtype)
        self.out[mx.array(rows), mx.array(ranks)] = y[:, 0]
        if self.evaluate:
            mx.eval(self.out)

    def result(self) -> mx.array:
        assert self.out is not None
        return self.out.reshape(*self.shape, self.out.shape[-1])


def ring_modules(original: nn.Module, banks: list[dict[str, Any]]) -> list[nn.Module]:
    """One copy of ``original`` (a SwitchGLU/SwitchMLP, quantized as the vault is) per
    bank, with each stacked parameter replaced by that bank's array of the same component
    name. The copies share everything else (activation, settings)."""
    from mlx.utils import tree_flatten, tree_unflatten

    names = {name for name, _ in tree_flatten(original.parameters())}
    missing = names - set(banks[0])
    extra = set(banks[0]) - names
    if missing or extra:
        raise VaultError(
            f"vault record components {sorted(banks[0])} do not match the model's expert "
            f"parameters {sorted(names)}; convert the model again with this S-MoE"
        )
    modules = []
    for i, arrays in enumerate(banks):
        module = original if i == 0 else _clone(original)
        module.update(tree_unflatten(list(arrays.items())))
        modules.append(module)
    return modules


def _clone(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s structure: child modules copied, arrays shared."""
    twin = copy.copy(module)
    for name, child in module.children().items():
        if isinstance(child, nn.Module):
            twin[name] = _clone(child)
    return twin


# mlx-lm's SwitchGLU/SwitchMLP sort their rows by expert from this many (token, rank) pairs.
SORT_FROM = 64


def switch_call(module: nn.Module, x: mx.array, indices: mx.array, sort: bool) -> mx.array:
    """``module(x, indices)``, or with ``sort`` the same computation with its rows sorted
    by expert even when there are fewer than SORT_FROM of them.

    A part of a call that mlx-lm makes sorted (a wave, the experts of one bank, those
    already resident) is then computed by the same kernels as in mlx-lm's call: on CUDA,
    sorted and unsorted calls use different kernels (a grouped GEMM, a matrix-vector
    product), whose rows round differently. The sorted path below is mlx-lm's own
    (switch_layers.SwitchGLU/SwitchMLP.__call__ with do_sort forced), for those two classes.
    """
    from mlx_lm.models import switch_layers as sl

    if not sort or indices.size >= SORT_FROM:
        return module(x, indices)  # mlx-lm decides: the same choice it makes in memory
    if not isinstance(module, sl.SwitchGLU | sl.SwitchMLP):
        return module(x, indices)
    x = mx.expand_dims(x, (-2, -3))
    indices = mx.stop_gradient(indices)
    x, idx, inv_order = sl._gather_sort(x, indices)
    if isinstance(module, sl.SwitchGLU):
        x_up = module.up_proj(x, idx, sorted_indices=True)
        x_gate = module.gate_proj(x, idx, sorted_indices=True)
        x = module.down_proj(module.activation(x_up, x_gate), idx, sorted_indices=True)
    else:
        x = module.fc2(
            module.activation(module.fc1(x, idx, sorted_indices=True)), idx, sorted_indices=True
        )
    return sl._scatter_unsort(x, inv_order, indices.shape).squeeze(-2)


def split_call(module: nn.Module, x: mx.array, indices: mx.array, sort: bool) -> mx.array:
    """``switch_call`` with its rows split over the CPU's cores where the call is on the
    CPU and large (a prefill chunk): each share runs on its own stream, and the shares'
    outputs are joined in order. Every row's bits are those of the whole call: on the CPU
    a row's result does not depend on the others in its call (the batched == solo tests),
    and each share keeps the whole call's sorted or unsorted kernels.

    x: [..., D]; indices: [..., k] -> [..., k, D] (lazy)."""
    lead, k = indices.shape[:-1], indices.shape[-1]
    rows = 1
    for n in lead:
        rows *= n
    # Our native kernels use every core within one call already (smoe.compute.native).
    bounds = None if is_native(module) else cpu_split.share_bounds(rows)
    if bounds is None:
        return switch_call(module, x, indices, sort)
    sort = sort or indices.size >= SORT_FROM  # the whole call's choice, for every share
    flat_x = x.reshape(rows, x.shape[-1])  # [R, D]
    flat_idx = indices.reshape(rows, k)  # [R, k]
    outs = []
    for stream, lo, hi in zip(cpu_split.cpu_streams(), bounds, bounds[1:], strict=False):
        with mx.stream(stream):
            outs.append(switch_call(module, flat_x[lo:hi], flat_idx[lo:hi], sort))  # [r, k, D]
    return mx.concatenate(outs, axis=0).reshape(*lead, k, -1)


def unsorted_call(module: nn.Module, x: mx.array, indices: mx.array) -> mx.array:
    """``module(x, indices)`` with its rows left in token order even from SORT_FROM rows
    up: mlx-lm's unsorted path (SwitchGLU/SwitchMLP.__call__ with do_sort False). On CUDA
    an unsorted float gather computes each row alone, as in a one-token call; a sorted
    one runs a grouped GEMM (docs/gpu.md)."""
    from mlx_lm.models import switch_layers as sl

    if indices.size < SORT_FROM or not isinstance(module, sl.SwitchGLU | sl.SwitchMLP):
        return module(x, indices)
    x = mx.expand_dims(x, (-2, -3))
    indices = mx.stop_gradient(indices)
    if isinstance(module, sl.SwitchGLU):
        x_up = module.up_proj(x, indices)
        x_gate = module.gate_proj(x, indices)
        x = module.down_proj(module.activation(x_up, x_gate), indices)
    else:
        x = module.fc2(module.activation(module.fc1(x, indices)), indices)
    return x.squeeze(-2)
