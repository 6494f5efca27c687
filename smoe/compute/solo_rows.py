"""One row, one arithmetic: every row of a batched or verify pass gets its solo bits.

On a GPU a row's bits depend on how many rows share the kernel call, because MLX picks
the kernel by the call's shape. The per-op fingerprint (bench/gpu/row_fingerprint.py,
docs/gpu.md) found, on CUDA with MLX 0.32:

- quantized matmuls and gathers (4 and 8 bits): a call of fewer than 8 rows runs the
  matrix-vector kernel, which computes each row on its own; from 8 rows a tiled kernel,
  which also computes each (token, rank) row on its own, but rounds otherwise. Within a
  kernel, a row's bits do not depend on the others;
- float dense matmuls: one row runs the matrix-vector kernel; more rows run cuBLAS;
- float gathers: unsorted calls compute each row on its own (whatever the count); sorted
  ones (mlx-lm sorts from 64 rows) run a grouped GEMM;
- norms, softmax, top-k, sums, RoPE: row-wise at any count. Attention over several query
  rows (a verify pass) rounds otherwise than one row at a time.

So MLX's own kernels are row-invariant once each call is shaped to pick the kernel the
row's reference call picks (``KernelRules``). The reference of a decode row is its solo
decode step (one token); of a prompt row, mlx-lm's call on the whole prompt chunk. This
module shapes calls that way:

- ``solo_rows(rules)``: the context in which a pass's rows must each get solo-decode
  bits (the runner enters it for batched decode and for verify passes);
- ``RowPieces``: wraps a row-wise module (a Linear, a router, an embedding's LM head) so
  that in that context it runs in pieces of rows that keep the solo kernel;
- ``expert_call``: a streamed expert call (all rows or a part: a wave, a bank) made with
  the reference call's kernel, by splitting it or padding it with repeated rows.

Nothing here changes arithmetic: it only chooses how many rows each MLX call gets.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from smoe.compute.row_gemv import FLOAT_KERNELS, exact_float_kernel
from smoe.compute.switch import SORT_FROM, split_call, switch_call, unsorted_call


@dataclass(frozen=True)
class KernelRules:
    """How a backend's kernels treat a call's rows, as far as a row's bits go.

    ``vector_below``: quantized calls with fewer rows use the per-row vector kernel,
    from this many a tiled one (None: no measured switch; calls keep solo shapes).
    ``float_rows``: rows a float dense call may have and keep a lone row's kernel.
    ``measured``: where the rules come from (docs/gpu.md), for messages and reports.
    ``float_kernel``: a ``row_gemv.FLOAT_KERNELS`` name that computes a bias-free float
    Linear's rows in one launch with lone-row bits (checked when the engine opens:
    ``row_gemv.exact_float_kernel``), or None: ``float_rows`` rows per call.
    """

    vector_below: int | None
    float_rows: int
    measured: str
    float_kernel: str | None = None

    def dense_rows(self, quantized: bool) -> int:
        """Rows per dense call that keep each row's solo kernel."""
        if quantized and self.vector_below is not None:
            return self.vector_below - 1
        return self.float_rows


# MLX 0.32 on CUDA, measured on an H200 (docs/gpu.md): qmv under 8 rows, gemv at 1 row.
CUDA = KernelRules(vector_below=8, float_rows=1, measured="CUDA, MLX 0.32 (H200 fingerprint)")
# A GPU whose kernels were not measured (Metal): every row in its solo call's own shape,
# one dense row and one token's experts per call, which is exact whatever the kernels do.
SOLO_SHAPES = KernelRules(vector_below=None, float_rows=1, measured="solo call shapes")

_ACTIVE: ContextVar[KernelRules | None] = ContextVar("smoe_solo_rows", default=None)


@contextlib.contextmanager
def solo_rows(rules: KernelRules | None) -> Iterator[None]:
    """Within: each row of a pass is computed with its solo decode step's kernels
    (``rules`` None: nothing changes, for a backend whose rows never depend on others)."""
    token = _ACTIVE.set(rules)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_rules() -> KernelRules | None:
    """The rules of the enclosing ``solo_rows`` (None outside one)."""
    return _ACTIVE.get()


def _concat_rows(outs: list[Any], lead: tuple[int, ...]) -> Any:
    """Pieces' outputs ([P, ...] each, or tuples of them) joined and given back the
    input's leading shape."""
    if isinstance(outs[0], tuple):
        return tuple(_concat_rows([o[i] for o in outs], lead) for i in range(len(outs[0])))
    y = mx.concatenate(outs, axis=0)
    return y.reshape(*lead, *y.shape[1:])


def in_pieces(fn: Any, x: mx.array, rows_per_call: int) -> Any:
    """``fn(x)`` for a row-wise ``fn``, computed ``rows_per_call`` rows [P, D] at a time.
    x: [..., D]; the result keeps x's leading shape."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])  # [R, D]
    if flat.shape[0] <= rows_per_call:
        return fn(x)
    outs = [fn(flat[s : s + rows_per_call]) for s in range(0, flat.shape[0], rows_per_call)]
    return _concat_rows(outs, lead)


def float_rows_at_once(kernel: str, x: mx.array, weight: mx.array) -> mx.array:
    """x [..., D] @ weight.T ([N, D]) -> [..., N] with every row's lone-call bits, in one
    launch of the ``row_gemv`` kernel named (a single row: the plain call, which is it)."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])  # [R, D]
    if flat.shape[0] == 1:
        return x @ weight.T
    # MLX's matmul of mixed dtypes (a bf16 row by a float32 router) promotes both first;
    # the kernels take one dtype, so promote as it does.
    if flat.dtype != weight.dtype:
        wide = mx.result_type(flat, weight)
        flat, weight = flat.astype(wide), weight.astype(wide)
    return FLOAT_KERNELS[kernel](flat, weight).reshape(*lead, -1)


def _is_quantized(module: nn.Module) -> bool:
    # A Module is a dict of its parameters and children: its values, not children()
    # (which builds a dict), keep this check cheap on every expert call (~1.7 us, was 7).
    return "scales" in module or any(
        isinstance(child, nn.Module) and "scales" in child for child in module.values()
    )


class RowPieces(nn.Module):
    """A row-wise module (Linear, QuantizedLinear, a router such as DeepSeek's MoEGate)
    that, inside ``solo_rows``, runs in pieces of rows keeping each row's solo kernel;
    elsewhere it is the wrapped module unchanged."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "_quantized", _is_quantized(inner))
        # A plain attribute: a lone request pays for this wrapper on every call (the
        # Module lookup of ``self.inner`` costs ~1 us more, and decode is host-bound).
        object.__setattr__(self, "_inner", inner)

    @property
    def weight(self) -> mx.array:  # routers are found by their weight (speculation, taps)
        return self.inner["weight"]  # type: ignore[no-any-return]

    def __call__(self, x: mx.array) -> Any:
        rules = _ACTIVE.get()
        if rules is None:
            return self._inner(x)
        if rules.float_kernel and self._plain_float_linear():
            return float_rows_at_once(rules.float_kernel, x, self.inner["weight"])
        return in_pieces(self.inner, x, rules.dense_rows(self._quantized))

    def _plain_float_linear(self) -> bool:
        # With a bias MLX runs even one row through cuBLAS (addmm): pieces keep that.
        return type(self.inner) is nn.Linear and "bias" not in self.inner


class RowPiecesEmbedding(nn.Module):
    """An embedding whose ``as_linear`` (a tied LM head) runs in row pieces inside
    ``solo_rows``; the lookup itself copies rows and needs nothing."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "_quantized", _is_quantized(inner))

    def __call__(self, x: mx.array) -> mx.array:
        return self.inner(x)  # type: ignore[no-any-return]

    def as_linear(self, x: mx.array) -> mx.array:
        rules = active_rules()
        if rules is None:
            return self.inner.as_linear(x)  # type: ignore[no-any-return]
        if rules.float_kernel and type(self.inner) is nn.Embedding:
            return float_rows_at_once(rules.float_kernel, x, self.inner.weight)
        return in_pieces(self.inner.as_linear, x, rules.dense_rows(self._quantized))  # type: ignore[no-any-return]


def install_row_pieces(
    model: nn.Module, skip: Callable[[nn.Module], bool], routers: list[nn.Module]
) -> int:
    """Wrap every Linear, QuantizedLinear and embedding of ``model`` (after its weights
    are loaded: parameter paths change), and each of ``routers`` (a MoE block's router that
    is not a Linear), in row pieces. Subtrees for which ``skip`` is true are left alone
    (an attention that already runs one row per call; streamed experts shape their own
    calls). Returns how many modules were wrapped."""
    wrapped = 0
    router_ids = {id(r) for r in routers}

    def wrap(module: Any) -> Any:
        nonlocal wrapped
        if isinstance(module, nn.Linear | nn.QuantizedLinear) or id(module) in router_ids:
            wrapped += 1
            return RowPieces(module)
        if isinstance(module, nn.Embedding | nn.QuantizedEmbedding):
            wrapped += 1
            return RowPiecesEmbedding(module)
        if isinstance(module, nn.Module) and not skip(module):
            visit(module)
        return module

    def visit(parent: nn.Module) -> None:
        for name, child in parent.children().items():
            if isinstance(child, nn.Module):  # (a Module is a dict: test it first)
                parent[name] = wrap(child)
            elif isinstance(child, list):
                parent[name] = [wrap(c) for c in child]
            elif isinstance(child, dict):
                parent[name] = {k: wrap(c) for k, c in child.items()}

    visit(model)
    return wrapped


def with_float_kernel(rules: KernelRules, model: nn.Module) -> KernelRules:
    """``rules`` with the ``row_gemv`` kernel that gives rows of ``model``'s float weights
    their lone call's bits on the current device, found by probing it in each float dtype
    the model holds (``float_kernel`` None where none does: one row per call stays)."""
    from mlx.utils import tree_flatten

    dtypes = {
        w.dtype for _, w in tree_flatten(model.parameters()) if mx.issubdtype(w.dtype, mx.floating)
    }
    return dataclasses.replace(rules, float_kernel=exact_float_kernel(sorted(dtypes, key=str)))


# ------------------------------------------------------------------------- streamed experts
def _pairs(x: mx.array, idx: mx.array) -> tuple[mx.array, mx.array]:
    """The call's (token, rank) rows: x [..., D], idx [..., k] -> xp [T*k, D], ip [T*k]."""
    k = idx.shape[-1]
    xf = x.reshape(-1, x.shape[-1])  # [T, D]
    return mx.repeat(xf, k, axis=0), idx.reshape(-1)


def _call_pairs(module: nn.Module, xp: mx.array, ip: mx.array) -> mx.array:
    """The experts of ``ip`` [P] on the rows ``xp`` [P, D], one row per pair: [P, D]."""
    return module(xp, ip[:, None])[:, 0]  # type: ignore[no-any-return]


def expert_call(
    module: nn.Module,
    x: mx.array,
    idx: mx.array,
    rules: KernelRules | None,
    reference_rows: int,
    sort: bool = False,
) -> mx.array:
    """``module(x, idx)`` -> [..., k, D] (mlx-lm's SwitchGLU/SwitchMLP on ring slots),
    with each (token, rank) row computed by the kernel its reference call uses.

    x: [..., D]; idx: [..., k] slot ids. ``reference_rows``: the (token, rank) rows of
    the call mlx-lm makes for these rows: one token's k inside ``solo_rows`` (a decode
    step), else the layer's whole call when this is a part of it (a wave, a bank).
    ``sort``: the whole call is one mlx-lm sorts (switch_call). ``rules`` None: mlx-lm's
    own call, for a backend whose rows never depend on others."""
    if rules is None:
        return split_call(module, x, idx, sort)  # (the CPU's cores share a large call)
    solo = active_rules() is not None
    k, lead = idx.shape[-1], idx.shape[:-1]
    if not _is_quantized(module):
        # Float gathers: unsorted calls compute rows alone; sorted ones group them.
        if solo:
            return unsorted_call(module, x, idx)
        return switch_call(module, x, idx, sort)
    if rules.vector_below is None:
        if not solo:
            return switch_call(module, x, idx, sort)
        tokens = x.reshape(-1, x.shape[-1])  # [T, D]: each token's k pairs in its solo call
        flat_idx = idx.reshape(-1, k)
        outs = [  # x [1, 1, D], idx [1, 1, k]: a decode step's own call
            module(tokens[t : t + 1][None], flat_idx[t : t + 1][None])
            for t in range(tokens.shape[0])
        ]
        return mx.concatenate(outs, axis=0).reshape(*lead, k, -1)
    rows = idx.size
    want_vector = reference_rows < rules.vector_below
    if want_vector and rows >= rules.vector_below:
        # Pieces of fewer rows than the tiled kernel takes, as the solo call has.
        xp, ip = _pairs(x, idx)
        step = rules.vector_below - 1
        outs = [
            _call_pairs(module, xp[s : s + step], ip[s : s + step]) for s in range(0, rows, step)
        ]
        return mx.concatenate(outs, axis=0).reshape(*lead, k, -1)
    if not want_vector and rows < rules.vector_below:
        # Too few rows for the tiled kernel the reference uses: the last row repeated
        # until there are enough; the repeats' results are dropped.
        xp, ip = _pairs(x, idx)
        extra = rules.vector_below - rows
        xp = mx.concatenate([xp, mx.repeat(xp[-1:], extra, axis=0)])
        ip = mx.concatenate([ip, mx.repeat(ip[-1:], extra)])
        return _call_pairs(module, xp, ip)[:rows].reshape(*lead, k, -1)
    return switch_call(module, x, idx, sort)


def reference_rows_of(idx_size: int, top_k: int) -> int:
    """The (token, rank) rows of the call a layer's rows are judged against: one token's
    ``top_k`` inside ``solo_rows`` (each row is its own decode step), else the call's."""
    return top_k if active_rules() is not None else idx_size


__all__ = [
    "CUDA",
    "SOLO_SHAPES",
    "SORT_FROM",
    "KernelRules",
    "RowPieces",
    "RowPiecesEmbedding",
    "active_rules",
    "expert_call",
    "float_rows_at_once",
    "in_pieces",
    "install_row_pieces",
    "reference_rows_of",
    "solo_rows",
    "with_float_kernel",
]
