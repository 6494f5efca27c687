"""Float dense products ``x @ W.T`` whose every row gets the bits of a lone row's call.

On CUDA a lone row (a decode step, [1, 1, D]) runs MLX's matrix-vector kernel (gemv);
two or more rows in one call run cuBLAS, which rounds otherwise. Two ways keep each row's
lone bits while launching one kernel for all of them (docs/gpu.md, bench/gpu/row_gemv.py):

- ``strided_rows``: the rows as a [R, 1, D] view whose strides MLX reads as transposed, so
  it does not fold the batch into one [R, D] matrix and runs its batched gemv instead: the
  same per-row code as the lone call, one launch, but the weight is read once per row;
- ``shared_weight_rows`` (CUDA only): a kernel of ours with MLX's gemv reduction order per
  row (each warp one output, 4/2/1 elements per lane, a warp reduce) that reads each
  weight element once for all the rows.

Both are checked against the lone call when the engine opens under kernel rules
(``exact_float_kernel``); where neither matches, a float Linear keeps one call per row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import mlx.core as mx

# MLX's gemv (mlx/backend/cuda/gemms/gemv.cu, 0.32): 8 outputs per block, one warp each.
_ROWS_PER_BLOCK = 8
_WARP = 32
MAX_SHARED_ROWS = 8  # rows one shared-weight launch accumulates (registers per lane)
# Outputs per warp of the shared-weight kernel, by output count (bench/gpu/row_gemv.py,
# H200): 2 is fastest for projections and routers, 8 for a vocabulary-wide head.
WIDE_OUTPUTS = 32768


def outs_per_warp(n_out: int) -> int:
    """How many outputs one warp computes for an N-output Linear (more reuse x's loads)."""
    return 8 if n_out >= WIDE_OUTPUTS else 2


def strided_rows(x: mx.array, weight: mx.array) -> mx.array:
    """x [R, D] @ weight.T ([N, D]) -> [R, N], each row through MLX's batched gemv."""
    rows, dim = x.shape
    # Strides (D, 1, 1): the size-1 axis makes the view look transposed to MLX, which then
    # keeps R batches of one row (batched gemv) instead of one [R, D] matmul (cuBLAS).
    view = mx.as_strided(x, (rows, 1, dim), (dim, 1, 1))
    return (view @ weight.T).reshape(rows, -1)


_HEADER = """
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
"""

# Each warp OUTS outputs n0.. n0+OUTS-1; lane l sums elements [NPT*l + 32*NPT*i, +NPT) of
# each row in the order MLX's gemv_impl does (one sum per output and row), then the warp
# reduce. A weight chunk is loaded once for all rows, a row's chunk once for OUTS outputs.
_SOURCE = """
    auto block = cg::this_thread_block();
    auto warp = cg::tiled_partition<32>(block);
    const int N = w_shape[0];
    const int K = w_shape[1];
    const int R = x_shape[0];  // at most MAX_ROWS: the sums stay in registers
    const int n0 = (blockIdx.x * 8 + threadIdx.y) * OUTS;
    if (n0 < N) {  // the same for the whole warp, as the reduce needs
        float sum[OUTS][MAX_ROWS];
        #pragma unroll
        for (int o = 0; o < OUTS; ++o)
            #pragma unroll
            for (int r = 0; r < MAX_ROWS; ++r) sum[o][r] = 0.0f;
        for (int col = NPT * warp.thread_rank(); col < K; col += 32 * NPT) {
            T wv[OUTS][NPT];
            #pragma unroll
            for (int o = 0; o < OUTS; ++o) {
                const T* wrow = w + (size_t)min(n0 + o, N - 1) * K + col;
                #pragma unroll
                for (int j = 0; j < NPT; ++j) wv[o][j] = wrow[j];
            }
            #pragma unroll
            for (int r = 0; r < MAX_ROWS; ++r) {
                if (r >= R) break;
                T xv[NPT];
                #pragma unroll
                for (int j = 0; j < NPT; ++j) xv[j] = x[(size_t)r * K + col + j];
                #pragma unroll
                for (int o = 0; o < OUTS; ++o)
                    #pragma unroll
                    for (int j = 0; j < NPT; ++j)
                        sum[o][r] += static_cast<float>(wv[o][j]) * static_cast<float>(xv[j]);
            }
        }
        #pragma unroll
        for (int o = 0; o < OUTS; ++o) {
            if (n0 + o >= N) break;
            #pragma unroll
            for (int r = 0; r < MAX_ROWS; ++r) {
                if (r >= R) break;
                float s = cg::reduce(warp, sum[o][r], cg::plus<float>());
                if (warp.thread_rank() == 0) out[(size_t)r * N + n0 + o] = static_cast<T>(s);
            }
        }
    }
"""

_kernel: Any = None


def _elements_per_lane(dim: int) -> int:
    """MLX's gemv choice: 4 elements per lane where D % 128 == 0, 2 where D % 64, else 1."""
    return 4 if dim % 128 == 0 else 2 if dim % 64 == 0 else 1


def shared_weight_rows(x: mx.array, weight: mx.array, outs: int | None = None) -> mx.array:
    """x [R, D] @ weight.T ([N, D], row-major) -> [R, N] on CUDA, each row's bits those of
    its lone gemv, the weight read once per ``MAX_SHARED_ROWS`` rows. ``outs``: outputs
    per warp (1: MLX's own layout; None: ``outs_per_warp``; more reuse each row's loads)."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="smoe_shared_weight_gemv",
            input_names=["x", "w"],
            output_names=["out"],
            source=_SOURCE,
            header=_HEADER,
        )
    rows, dim = x.shape
    n_out = weight.shape[0]
    outs = outs or outs_per_warp(n_out)
    blocks = -(-n_out // (_ROWS_PER_BLOCK * outs))
    results = []
    for start in range(0, rows, MAX_SHARED_ROWS):
        part = x[start : start + MAX_SHARED_ROWS]
        (y,) = _kernel(
            inputs=[part, weight],
            # Row count read at run time: one compiled kernel per dtype and lane width.
            template=[
                ("T", x.dtype),
                ("MAX_ROWS", MAX_SHARED_ROWS),
                ("NPT", _elements_per_lane(dim)),
                ("OUTS", outs),
            ],
            grid=(blocks * _WARP, _ROWS_PER_BLOCK, 1),
            threadgroup=(_WARP, _ROWS_PER_BLOCK, 1),
            output_shapes=[(part.shape[0], n_out)],
            output_dtypes=[x.dtype],
        )
        results.append(y)
    return results[0] if len(results) == 1 else mx.concatenate(results, axis=0)


def lone_rows(x: mx.array, weight: mx.array) -> mx.array:
    """The reference: each row of x [R, D] in its own decode-shaped call [1, 1, D]."""
    return mx.concatenate([x[r : r + 1][None] @ weight.T for r in range(x.shape[0])]).reshape(
        x.shape[0], -1
    )


FLOAT_KERNELS: dict[str, Callable[[mx.array, mx.array], mx.array]] = {
    "shared": shared_weight_rows,  # preferred: reads the weight once for all the rows
    "strided": strided_rows,
}
# Probe shapes: one inner size per lane width MLX's gemv picks (4, 2, 1 elements per
# lane); row counts a batch or a verify pass has, one past a shared launch's rows.
_PROBE_DIMS = (256, 320, 200)
_PROBE_ROWS = (2, 5, 8, MAX_SHARED_ROWS + 3)


def _gives_lone_bits(fn: Callable[[mx.array, mx.array], mx.array], dtype: mx.Dtype) -> bool:
    for dim in _PROBE_DIMS:
        w = (mx.random.normal((72, dim), key=mx.random.key(dim)) * 0.05).astype(dtype)
        for rows in _PROBE_ROWS:
            x = mx.random.normal((rows, dim), key=mx.random.key(rows)).astype(dtype)
            if not mx.array_equal(fn(x, w), lone_rows(x, w)).item():
                return False
    return True


def exact_float_kernel(dtypes: Iterable[mx.Dtype]) -> str | None:
    """The first of ``FLOAT_KERNELS`` that gives every probed row its lone call's bits in
    each of ``dtypes`` on the current device, or None (then one call per row is kept).
    A kernel this backend lacks (ours off CUDA) counts as not matching."""
    wanted = list(dtypes)
    for name, fn in FLOAT_KERNELS.items():
        try:
            if all(_gives_lone_bits(fn, dtype) for dtype in wanted):
                return name
        except RuntimeError:  # "[cuda_kernel] No CUDA back-end." and the like
            continue
    return None


__all__ = [
    "FLOAT_KERNELS",
    "MAX_SHARED_ROWS",
    "outs_per_warp",
    "exact_float_kernel",
    "lone_rows",
    "shared_weight_rows",
    "strided_rows",
]
