"""Float dense rows in one launch with each row's lone-call bits (issue 26): are
``strided_rows`` (MLX's batched gemv) and ``shared_weight_rows`` (our kernel, CUDA) bit for
bit the lone decode-shaped call, and what do they cost against one call per row and
against one plain matmul of all the rows (cuBLAS, which rounds otherwise)?

    python bench/gpu/row_gemv.py [--quick] > row_gemv.json

Shapes are Qwen3-235B's backbone: q/o projections, k/v, the router, the LM head.
Prints JSON: per dtype, shape and row count, rows differing from lone and median ms.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import mlx.core as mx
import numpy as np

from smoe.compute.row_gemv import lone_rows, shared_weight_rows, strided_rows

SHAPES = {  # name: (N outputs, D inputs)
    "q_proj": (8192, 4096),
    "o_proj": (4096, 8192),
    "k_proj": (512, 4096),
    "router": (128, 4096),
    "lm_head": (151936, 4096),
    "odd_d": (384, 200),  # D % 64 != 0: one element per lane
    "d64": (256, 320),  # D % 64 == 0, % 128 != 0: two per lane
}


def differing(a: mx.array, b: mx.array) -> int:
    a32, b32 = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    return int(np.sum(np.any(a32 != b32, axis=1)))


def timed(fn, repeats: int) -> float:
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return round(float(np.median(times)) * 1e3, 4)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    gpu = mx.default_device() == mx.gpu
    rows_list = [1, 2, 3, 4, 7, 8, 9, 16, 17] if not args.quick else [1, 2, 9]
    repeats = 5 if args.quick else 30
    out = []
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        for name, (n, d) in SHAPES.items():
            w = (mx.random.normal((n, d), key=mx.random.key(1)) * 0.05).astype(dtype)
            for rows in rows_list:
                x = mx.random.normal((rows, d), key=mx.random.key(2 + rows)).astype(dtype)
                lone = lone_rows(x, w)
                row = {"dtype": str(dtype), "shape": name, "rows": rows}
                row["strided_differ"] = differing(strided_rows(x, w), lone)
                row["matmul_differ"] = differing(x @ w.T, lone)
                if gpu:
                    for outs in (1, 2, 4, 8):
                        row[f"shared_{outs}_differ"] = differing(
                            shared_weight_rows(x, w, outs), lone
                        )
                if rows in (1, 2, 4, 8) and name in ("q_proj", "lm_head", "router"):
                    row["ms_lone"] = timed(lambda x=x, w=w: lone_rows(x, w), repeats)
                    row["ms_strided"] = timed(lambda x=x, w=w: strided_rows(x, w), repeats)
                    row["ms_matmul"] = timed(lambda x=x, w=w: x @ w.T, repeats)
                    if gpu:
                        for outs in (1, 2, 4, 8):
                            row[f"ms_shared_{outs}"] = timed(
                                lambda x=x, w=w, o=outs: shared_weight_rows(x, w, o), repeats
                            )
                out.append(row)
                print(json.dumps(row), file=sys.stderr)
    print(json.dumps({"benchmark": "row_gemv", "device": str(mx.default_device()), "rows": out}))


if __name__ == "__main__":
    main()
