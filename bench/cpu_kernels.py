"""S-MoE's CPU kernels (smoe._cpu_kernels) against MLX's, at the models' shapes: GFLOP/s
of one call at decode (1 row) and prefill (64 rows) for Qwen3-30B-A3B's and
Qwen3-235B-A22B's experts and attention projections, 4-bit (group 64) and float32, each
result checked bit for bit against MLX's. MLX's kernel runs on one core (its CPU kernels
do); ours on one thread and on every core (its pool). The yardstick: one core's
float32 multiply-then-add peak in the same vectors (``peak``: a multiply and an add a
flop each; the kernels do both per term, as MLX does). JSON out.

    python bench/cpu_kernels.py [--rounds 5] [--shapes q30,q235] [--kinds 4bit,float32]

GFLOP/s counts 2 flops per multiply-add (x[k] * w[n, k] summed), as bench/cpu_expert_matmul.py
does; the kernels' dequantization (two more operations per weight) is not counted.
"""

from __future__ import annotations

import statistics
import sys
import time

import harness
import mlx.core as mx
import numpy as np

from smoe.compute.native import Native

# (N outputs, K inputs) per model: expert gate/up and down, attention q, k (= v) and o.
SHAPES = {
    "q30": {
        "expert gate/up": (768, 2048),
        "expert down": (2048, 768),
        "attention q": (4096, 2048),
        "attention k/v": (512, 2048),
        "attention o": (2048, 4096),
    },
    "q235": {
        "expert gate/up": (1536, 4096),
        "expert down": (4096, 1536),
        "attention q": (8192, 4096),
        "attention k/v": (512, 4096),
        "attention o": (4096, 8192),
    },
}


def timed(fn, rounds: int, least_s: float = 0.05) -> float:
    """The median over ``rounds`` of one call's seconds, each round calling ``fn`` back to
    back for at least ``least_s`` (a decode step's calls come so), after warm calls.
    One timed call of ~0.1 ms on a shared VM is mostly the noise around it."""
    for _ in range(3):
        fn()
    per_call = []
    for _ in range(rounds):
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < least_s or calls < 3:
            fn()
            calls += 1
        per_call.append(elapsed / calls)
    return statistics.median(per_call)


def memory_read_rate(rounds: int = 5) -> float:
    """Bytes/s of a 512 MB float32 matrix-vector product through numpy's BLAS on every core:
    the rate a one-row float32 call is bounded by (4 bytes read per multiply-add)."""
    a = np.ones((8192, 16384), np.float32)
    v = np.ones(16384, np.float32)
    return a.nbytes / timed(lambda: a @ v, rounds, least_s=0.2)


def one_shape(ext, n: int, k: int, kind: str, rows: int, rounds: int, threads: int) -> dict:
    rng = np.random.default_rng(n * 7 + k)
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
    x = mx.array(rng.standard_normal((rows, k)).astype(np.float32))
    flops = 2.0 * rows * n * k
    out = np.empty((rows, n), np.float32)
    xn = np.array(x)
    if kind == "4bit":
        wq, s, b = mx.quantize(w, group_size=64, bits=4)
        mx.eval(wq, s, b)
        wn, sn, bn = np.array(wq), np.array(s), np.array(b)

        def mlx_call():
            y = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=4)
            mx.eval(y)
            return y

        def ours():
            ext.matmul(xn, wn, out, scales=sn, biases=bn, bits=4, group=64)
    else:
        wn = np.array(w)

        def mlx_call():
            y = x @ w.T
            mx.eval(y)
            return y

        def ours():
            ext.matmul(xn, wn, out)

    t_mlx = timed(mlx_call, rounds)
    ext.set_threads(1)
    t_one = timed(ours, rounds)
    ext.set_threads(threads)
    t_all = timed(ours, rounds)
    ext.set_threads(0)
    same = bool(np.array_equal(np.array(mlx_call()), out))
    return {
        "rows": rows,
        "mlx_gflops": round(flops / t_mlx / 1e9, 2),
        "ours_one_thread_gflops": round(flops / t_one / 1e9, 2),
        "ours_gflops": round(flops / t_all / 1e9, 2),
        "vs_mlx": round(t_mlx / t_all, 2),
        "vs_mlx_per_core": round(t_mlx / t_one, 2),
        "bits_equal": same,
    }


def main() -> None:
    p = harness.parser(__doc__)
    harness.rounds(p, default=5)
    p.add_argument("--shapes", default="q30,q235", help="comma list of: q30, q235")
    p.add_argument("--kinds", default="4bit,float32", help="comma list of: 4bit, float32")
    args = p.parse_args()
    native = Native.here()
    if not native.on:
        raise SystemExit(f"no native kernels here: {native.why_not}")
    ext = native.ext
    mx.set_default_device(mx.cpu)
    threads = int(ext.threads())
    peak = float(ext.peak())
    report: dict = {
        "isa": ext.isa(),
        "threads": threads,
        "peak_gflops_per_core": round(peak / 1e9, 1),
        "shapes": {},
    }
    for model in args.shapes.split(","):
        for name, (n, k) in SHAPES[model].items():
            for kind in args.kinds.split(","):
                for rows in (1, 64):
                    key = f"{model} {name} {kind}"
                    r = one_shape(ext, n, k, kind, rows, args.rounds, threads)
                    r["ours_share_of_peak"] = round(r["ours_one_thread_gflops"] * 1e9 / peak, 3)
                    report["shapes"].setdefault(key, []).append(r)
                    print(f"{key} rows {rows}: {r}", file=sys.stderr, flush=True)
    all_rows = [r for rs in report["shapes"].values() for r in rs]
    rate = memory_read_rate()
    report["memory_read_gb_s"] = round(rate / 1e9, 1)
    # a one-row float32 call reads 4 bytes per multiply-add (2 flops): its ceiling
    report["float32_rows_1_ceiling_gflops"] = round(rate / 2 / 1e9, 1)
    report["all_bits_equal"] = all(r["bits_equal"] for r in all_rows)
    for rows in (1, 64):
        ratios = [r["vs_mlx"] for r in all_rows if r["rows"] == rows]
        report[f"min_vs_mlx_rows_{rows}"] = min(ratios)
    harness.report(report, args)


if __name__ == "__main__":
    main()
