"""What one expert call costs over rings of growing size, by scale dtype (CPU or GPU).

    python bench/ring_cost.py    # JSON: per (scales dtype, slots) ms per call, MB touched

A decode-shaped 4-bit gather_qmm (one token, 8 experts, Qwen3-30B-A3B expert geometry) over
[S, 768, 2048/8] weights. With float32 activations and bfloat16 scales the kernel converts
every slot's scales on every call, so its cost grows with S: why the staged ring keeps
records in the compute dtype (docs/gpu.md).
"""

from __future__ import annotations

import time

import harness
import mlx.core as mx


def main() -> None:
    args = harness.parser(__doc__).parse_args()
    d, o, gs = 2048, 768, 64
    rows = []
    for scales_dtype in (mx.bfloat16, mx.float32):
        for slots in (16, 128, 512):
            w = mx.random.randint(0, 2**31, (slots, o, d // 8)).astype(mx.uint32)
            s = (mx.random.normal((slots, o, d // gs)) * 0.01).astype(scales_dtype)
            b = (mx.random.normal((slots, o, d // gs)) * 0.01).astype(scales_dtype)
            x = mx.random.normal((1, 1, 1, d))
            idx = mx.array([[1, 5, 7, 9, 2, 3, 4, 6]], mx.uint32)

            def call(w=w, s=s, b=b, x=x, idx=idx) -> None:
                mx.eval(
                    mx.gather_qmm(
                        x, w, s, b, rhs_indices=idx, transpose=True, group_size=gs, bits=4
                    )
                )

            mx.eval(w, s, b)
            call()
            mx.synchronize()
            mx.reset_peak_memory()
            before = mx.get_active_memory()
            start = time.perf_counter()
            for _ in range(10):
                call()
            rows.append(
                {
                    "scales": str(scales_dtype).split(".")[-1],
                    "slots": slots,
                    "ms_per_call": round((time.perf_counter() - start) * 100, 2),
                    "MB_touched_per_call": round((mx.get_peak_memory() - before) / 1e6, 2),
                }
            )
    harness.report({"rows": rows}, args)


if __name__ == "__main__":
    main()
