"""Where a batched decode step's time goes at 1, 2, 4 and 8 rows, with the kernel rules on
and off (issue 26): the host building the lazy graph (and its size in primitives), then evaluating it (the device's
work, plus what launching it costs the host), then reading each row's token back.

    python bench/batch_build_cost.py VAULT [--device gpu] [--rows 1,2,4,8] [--repeats 7]

Every expert is made resident first. A batched step is built on the host while the device
waits, unless it is built ahead (Runner.step_batch on a resident model); this measures what
that build costs per row. Prints JSON: median milliseconds of each part per row count and
rules (``sample_ms``: one greedy draw read back per row, as a step not built ahead did).
"""

from __future__ import annotations

import io
import json
import re
import statistics
import sys
import time

import harness
import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache

import smoe.util.loop
from smoe.bench.resident import fill_ring
from smoe.compute.rowwise import RowCaches
from smoe.compute.solo_rows import CUDA, solo_rows
from smoe.engine import Engine
from smoe.sampling import SamplingParams
from smoe.vault.format import Vault


def primitives(y: mx.array) -> int:
    """How many primitives the lazy graph of ``y`` holds (MLX's dot export, one node each)."""
    dot = io.StringIO()
    mx.export_to_dot(dot, y)
    return len(re.findall(r'label ="[A-Za-z]', dot.getvalue()))


def build_times(runner, rows: list[int], repeats: int, opened) -> list[dict]:
    """``opened``: the rules the engine opened with (float kernel probed: row_gemv); run
    beside no rules and CUDA's rules with float Linears in one-row pieces."""
    seqs = [runner.start([5 + i, 17, 99, 300, 42], SamplingParams()) for i in range(max(rows))]
    out = []
    variants = {"none": None, "pieces": CUDA}
    if opened is not None and opened.float_kernel:
        variants[opened.float_kernel] = opened
    for label, rules in variants.items():
        for n in rows:
            batch, times, evals, samples = seqs[:n], [], [], []
            for _ in range(repeats):
                caches = [
                    RowCaches(list(layer)) for layer in zip(*(s.cache for s in batch), strict=True)
                ]
                tokens = mx.array([[s.tokens[-1]] for s in batch])  # [B, 1]
                start = time.perf_counter()
                with solo_rows(rules):
                    y = runner.model(tokens, cache=caches if n > 1 else batch[0].cache)
                built = time.perf_counter()
                if not times:  # the graph's size: what launching it costs grows with it
                    size = primitives(y)
                mx.eval(y)
                evaluated = time.perf_counter()
                for i in range(n):  # [1, V] -> token, one sync each
                    int(mx.argmax(y[i : i + 1, -1, :], axis=-1).item())
                times.append(built - start)
                evals.append(evaluated - built)
                samples.append(time.perf_counter() - evaluated)
                for s in batch:  # leave the caches as they were
                    trim_prompt_cache(s.cache, 1)
            ms = statistics.median(times) * 1e3
            out.append(
                {
                    "rules": label,
                    "rows": n,
                    "build_ms": round(ms, 3),
                    "build_per_row_ms": round(ms / n, 3),
                    "primitives": size,
                    "eval_ms": round(statistics.median(evals) * 1e3, 3),
                    "sample_ms": round(statistics.median(samples) * 1e3, 3),
                }
            )
            print(json.dumps(out[-1]), file=sys.stderr)
    return out


async def main() -> None:
    p = harness.parser(__doc__)
    harness.vault(p)
    harness.device(p)
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    every = Vault.open(args.vault).manifest.num_records
    async with Engine.open(args.vault, slots=every, device=args.device, max_batch=8) as engine:
        await fill_ring(engine)
        runs = await engine.debug.compute.run(
            build_times, engine.debug.runner, rows, args.repeats, engine.debug.runner.rules
        )
    harness.report(
        {"benchmark": "batch_build_cost", "vault": args.vault, "device": args.device, "runs": runs},
        args,
    )


if __name__ == "__main__":
    smoe.util.loop.run(main())
