"""Does a row of a sorted float gather_mm depend on which slots hold the experts? mlx-lm's
SwitchGLU (gpt_oss demo geometry: 16 experts, hidden 256, intermediate 128, top-4) on a
40-token prompt chunk, its experts stacked in memory, against the same weights placed in a
96-slot bank under several expert -> slot maps, called with slot ids. Prints JSON: rows
whose bits differ from the in-memory call, per map, for sorted (160 rows) and unsorted
(8 tokens: 32 rows) calls, float and 4-bit.

    python bench/gpu/gather_order.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402  (puts the checkout first on sys.path)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.switch_layers import SwitchGLU  # noqa: E402

E, S, D, F, K = 16, 96, 256, 128, 4


def main() -> None:
    args = harness.parser(__doc__).parse_args()
    rng = np.random.default_rng(0)
    key = mx.random.key(0)
    out = {}
    # bfloat16 as on a GPU; the CPU's gather_mm is float32 only (a dry run there)
    dt = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    for quantized in (False, True):
        base = SwitchGLU(D, F, E, bias=True)
        for name in ("gate_proj", "up_proj", "down_proj"):
            proj = getattr(base, name)
            key, k1, k2 = mx.random.split(key, 3)
            proj.weight = (mx.random.normal(proj.weight.shape, key=k1) * 0.05).astype(dt)
            proj.bias = (mx.random.normal(proj.bias.shape, key=k2) * 0.05).astype(dt)
        if quantized:
            import mlx.nn as nn

            nn.quantize(
                base, group_size=64, bits=4, class_predicate=lambda p, m: hasattr(m, "to_quantized")
            )
        from mlx.utils import tree_flatten, tree_unflatten

        flat = dict(tree_flatten(base.parameters()))
        mx.eval(flat)
        for tokens in (40, 8):
            x = mx.random.normal((1, tokens, D), key=mx.random.key(tokens)).astype(dt)
            idx = np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)])[None]
            want = base(x, mx.array(idx, dtype=mx.uint32))
            mx.eval(want)
            maps = {
                "identity": np.arange(E),
                "offset, ascending": 32 + np.arange(E),
                "reversed": 80 - np.arange(E),
                "random": rng.permutation(S)[:E],
                "random within 16": rng.permutation(E),
            }
            for name, slot_of in maps.items():
                bank = {}
                for pname, a in flat.items():
                    z = mx.zeros((S, *a.shape[1:]), a.dtype)
                    for e in range(E):  # as the staged ring commits: one slot at a time
                        z[int(slot_of[e])] = a[e]
                    bank[pname] = z
                mx.eval(bank)
                ring = SwitchGLU(D, F, S, bias=True)
                if quantized:
                    import mlx.nn as nn

                    nn.quantize(
                        ring,
                        group_size=64,
                        bits=4,
                        class_predicate=lambda p, m: hasattr(m, "to_quantized"),
                    )
                ring.update(tree_unflatten(list(bank.items())))
                got = ring(x, mx.array(slot_of[idx], dtype=mx.uint32))
                same = mx.all(got == want, axis=(-1,)).reshape(-1)  # per (token, rank) row
                out[f"{'4-bit' if quantized else 'float'}, {tokens * K} rows, {name}"] = (
                    f"{int(same.sum().item())}/{same.size} rows equal"
                )
    harness.report({"device": str(mx.default_device()), "results": out}, args)


if __name__ == "__main__":
    main()
