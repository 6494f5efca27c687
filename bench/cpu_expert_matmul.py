"""How fast MLX's CPU computes one MoE layer's experts for a prefill chunk, and whether the
second core helps: the quantized expert matmuls (mlx-lm's SwitchGLU at 4 bits, group 64,
Qwen3-30B-A3B geometry) for a chunk's (token, expert) pairs, computed on one MLX stream,
then split over two CPU streams (each stream has its own thread), and the result checked
bit for bit against the one-stream call; then a backbone linear layer of the same model
(q_proj, hidden -> 2 x hidden) for the chunk, float32 and 4-bit, whole and with its rows
split over the cores as the engine runs it (smoe.compute.cpu_split), under the BLAS this
process has (MLX's bundled one, or SMOE_CPU_BLAS / LD_PRELOAD's) (JSON out).

    python bench/cpu_expert_matmul.py [--tokens 64] [--experts 128] [--top-k 8] [--rounds 3]

GFLOP/s counts 2 flops per multiply-add of the three projections (gate, up, down).
"""

from __future__ import annotations

import statistics
import time

import harness
import mlx.core as mx
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU

from smoe.util import blas


def layer(hidden: int, inter: int, experts: int) -> SwitchGLU:
    mx.random.seed(0)
    mod = SwitchGLU(hidden, inter, experts)
    import mlx.nn as nn

    nn.quantize(mod, group_size=64, bits=4)
    mx.eval(mod.parameters())
    return mod


def timed(fn, rounds: int) -> tuple[float, mx.array]:
    out = fn()
    mx.eval(out)  # warm: kernels built
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        out = fn()
        mx.eval(out)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def backbone_linears(x: mx.array, hidden: int, rounds: int) -> dict:
    """q_proj on the chunk [1, T, hidden], float32 and 4-bit: whole, and split by rows over
    the CPU's streams (cpu_split.split_rows); ms and whether the bits are equal."""
    import mlx.nn as nn

    from smoe.compute.cpu_split import split_rows

    out = {}
    for kind in ("float32", "4-bit"):
        mx.random.seed(1)
        lin = nn.Linear(hidden, 2 * hidden, bias=False)
        if kind == "4-bit":
            lin = nn.QuantizedLinear.from_linear(lin, 64, 4)
        mx.eval(lin.parameters())
        whole_s, whole = timed(lambda lin=lin: lin(x), rounds)
        split_s, split = timed(lambda lin=lin: split_rows(lin, x), rounds)
        out[kind] = {
            "whole_ms": round(whole_s * 1e3, 1),
            "split_ms": round(split_s * 1e3, 1),
            "split_equal_whole": bool(np.array_equal(np.array(split), np.array(whole))),
        }
    return out


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    harness.rounds(p, default=3)
    a = p.parse_args()
    mx.set_default_device(mx.cpu)
    mod = layer(a.hidden, a.inter, a.experts)
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((1, a.tokens, a.hidden)).astype(np.float32))
    idx = np.stack([rng.choice(a.experts, a.top_k, replace=False) for _ in range(a.tokens)])
    ids = mx.array(idx[None].astype(np.uint32))  # [1, T, k]
    flops = 2 * 3 * a.hidden * a.inter * a.tokens * a.top_k

    one_s, want = timed(lambda: mod(x, ids), a.rounds)

    # Two streams: the tokens split in halves, each half's call on its own CPU stream.
    streams = [mx.new_stream(mx.cpu), mx.new_stream(mx.cpu)]
    half = a.tokens // 2

    def split() -> mx.array:
        outs = []
        for s, (lo, hi) in zip(streams, [(0, half), (half, a.tokens)], strict=True):
            with mx.stream(s):
                outs.append(mod(x[:, lo:hi], ids[:, lo:hi]))
        return mx.concatenate(outs, axis=1)

    two_s, got = timed(split, a.rounds)
    # And the same halves on one stream: what splitting alone changes.
    halves_s, halves = timed(
        lambda: mx.concatenate(
            [mod(x[:, :half], ids[:, :half]), mod(x[:, half:], ids[:, half:])], 1
        ),
        a.rounds,
    )

    # The other arithmetic: each expert's weights dequantized to float32, then BLAS matmuls
    # (not mlx-lm's quantized kernel: other bits, compared by size of difference only).
    def dequantized() -> mx.array:
        import mlx.nn as nn

        flat_x = x[0]  # [T, D]
        out = mx.zeros((a.tokens, a.top_k, a.hidden))
        for e in sorted(set(idx.reshape(-1).tolist())):
            rows, ranks = np.nonzero(idx == e)
            xe = flat_x[mx.array(rows)]
            ws = []
            for proj in (mod.gate_proj, mod.up_proj, mod.down_proj):
                ws.append(mx.dequantize(proj.weight[e], proj.scales[e], proj.biases[e], 64, 4))
            h = nn.silu(xe @ ws[0].T) * (xe @ ws[1].T)
            out[mx.array(rows), mx.array(ranks)] = h @ ws[2].T
        return out[None]

    deq_s, deq = timed(dequantized, a.rounds)
    # What the cores reach on dense float32 work (BLAS through MLX): the ceiling to compare.
    dense = mx.array(rng.standard_normal((2048, 2048)).astype(np.float32))
    dense_s, _ = timed(lambda: dense @ dense, a.rounds)
    dense_gflops = 2 * 2048**3 / dense_s / 1e9
    # ... and through numpy's BLAS (OpenBLAS here): what the cores can do at all.
    host = np.array(dense)
    host @ host
    start = time.perf_counter()
    for _ in range(a.rounds):
        host @ host
    blas_gflops = 2 * 2048**3 * a.rounds / (time.perf_counter() - start) / 1e9
    linears = backbone_linears(x, a.hidden, a.rounds)
    report = {
        "benchmark": "cpu_expert_matmul",
        "cpu_blas": blas.in_use(),
        "backbone_linear": linears,
        "shape": {
            "tokens": a.tokens,
            "top_k": a.top_k,
            "hidden": a.hidden,
            "inter": a.inter,
            "experts": a.experts,
            "bits": 4,
            "group_size": 64,
            "dtype": "float32",
        },
        "one_stream_s": round(one_s, 4),
        "one_stream_gflops": round(flops / one_s / 1e9, 2),
        "halves_one_stream_s": round(halves_s, 4),
        "two_streams_s": round(two_s, 4),
        "two_streams_gflops": round(flops / two_s / 1e9, 2),
        "speedup_two_streams": round(one_s / two_s, 3),
        "dense_float32_matmul_gflops": round(dense_gflops, 1),
        "share_of_dense_one_stream": round(flops / one_s / 1e9 / dense_gflops, 3),
        "numpy_blas_float32_gflops": round(blas_gflops, 1),
        "dequantized_float_s": round(deq_s, 4),
        "dequantized_float_gflops": round(flops / deq_s / 1e9, 2),
        "dequantized_max_abs_diff": float(np.abs(np.array(deq) - np.array(want)).max()),
        "halves_equal_whole": bool(np.array_equal(np.array(halves), np.array(want))),
        "two_streams_equal_halves": bool(np.array_equal(np.array(got), np.array(halves))),
    }
    harness.report(report, a)


if __name__ == "__main__":
    main()
