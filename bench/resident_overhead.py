"""What a resident decode token costs the engine beyond mlx-lm's, taken apart: the same
prompt decoded by the runner's own loop (no event loop), by ``Engine.generate`` (the
compute thread and the loop), and by mlx-lm's ``generate_step`` on the same weights, in
alternating rounds in one process; then the host time to build one token's lazy graph and
the number of primitives in it, for the engine's model and mlx-lm's; then one decode loop
shaped as mlx-lm's on each model, each token split into build, queue and wait.

    python bench/resident_overhead.py VAULT [--device gpu] [--tokens 96] [--rounds 4]

runner against mlx-lm is the model code's cost; engine against runner is the thread
hand-off and the event loop's. Prints JSON (ms per token per round, medians).
"""

from __future__ import annotations

import io
import re
import statistics
import time
from typing import Any

import harness
import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

import smoe.util.loop
from smoe.bench.resident import fill_ring
from smoe.compute.model import resident_model
from smoe.engine import Engine
from smoe.sampling import SamplingParams
from smoe.vault.format import Vault

PROMPT = [5, 17, 99, 300, 42, 7, 250, 600]


def runner_ms(runner: Any, tokens: int) -> float:
    """ms per token of the runner's own decode loop, after its first token."""
    seq = runner.start(PROMPT, SamplingParams())
    runner.step(seq)
    start = time.perf_counter()
    for i in range(tokens):
        runner.step(seq, more=i < tokens - 1)
    return (time.perf_counter() - start) / tokens * 1e3


def mlx_lm_ms(model: Any, tokens: int) -> float:
    """ms per token of mlx-lm's generate_step, after its first two tokens."""
    start = 0.0
    for i, _ in enumerate(generate_step(mx.array(PROMPT), model, max_tokens=tokens + 2)):
        if i == 1:
            start = time.perf_counter()
    return (time.perf_counter() - start) / tokens * 1e3


async def engine_ms(engine: Engine, tokens: int) -> float:
    """ms per token of Engine.generate, after its first two tokens."""
    start, seen = 0.0, 0
    async for ev in engine.generate(PROMPT, max_tokens=tokens + 2, stop_at_eos=False):
        if ev.token is not None:
            seen += 1
            if seen == 2:
                start = time.perf_counter()
    return (time.perf_counter() - start) / tokens * 1e3


def timeline_ms(model: Any, cache: Any, tokens: int) -> dict[str, float]:
    """One greedy decode loop shaped as mlx-lm's generate_step (token n+1 built and queued
    before token n is read), on any model and cache, with each token's host time split:
    ``build`` (the Python forward pass), ``queue`` (async_eval: MLX walks and launches the
    graph), ``wait`` (``item``: the device finishing the previous pass). Medians, ms."""
    phases: dict[str, list[float]] = {"build": [], "queue": [], "wait": [], "step": []}
    y = mx.argmax(model(mx.array([[17]]), cache=cache)[:, -1, :], axis=-1)  # [1]
    mx.async_eval(y)
    for _ in range(tokens):
        t0 = time.perf_counter()
        nxt = mx.argmax(model(y[None], cache=cache)[:, -1, :], axis=-1)
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        y.item()
        t3 = time.perf_counter()
        for name, ms in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
            phases[name].append(ms * 1e3)
        y = nxt
    mx.eval(y)
    trim_prompt_cache(cache, tokens + 1)
    return {k: round(statistics.median(v), 3) for k, v in phases.items()}


def graph_cost(model: Any, cache: Any, repeats: int = 30) -> dict[str, float]:
    """Median host ms to build one decode token's graph and to evaluate it (synchronously:
    MLX's walk and launches plus the device), and the graph's size."""
    times, evals = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        y = model(mx.array([[17]]), cache=cache)  # [1, 1, V]
        built = time.perf_counter()
        mx.eval(y)
        evals.append(time.perf_counter() - built)
        times.append(built - start)
        trim_prompt_cache(cache, 1)
    y = model(mx.array([[17]]), cache=cache)
    dot = io.StringIO()
    mx.export_to_dot(dot, y)
    mx.eval(y)
    trim_prompt_cache(cache, 1)
    primitives = len(re.findall(r'label ="[A-Za-z]', dot.getvalue()))
    return {
        "build_ms": round(statistics.median(times) * 1e3, 3),
        "eval_ms": round(statistics.median(evals) * 1e3, 3),
        "primitives": primitives,
    }


def engine_graph_cost(runner: Any, tokens: int) -> dict[str, Any]:
    seq = runner.start(PROMPT, SamplingParams())
    return timed(runner.model, seq.cache, tokens)


def timed(model: Any, cache: Any, tokens: int) -> dict[str, Any]:
    """graph_cost, then the timeline on the thread's default stream and on mlx-lm's
    generation stream (generate_step runs there: does the stream matter?)."""
    cost: dict[str, Any] = graph_cost(model, cache)
    cost["timeline_ms"] = timeline_ms(model, cache, tokens)
    with mx.stream(generation_stream):
        cost["timeline_generation_stream_ms"] = timeline_ms(model, cache, tokens)
    return cost


async def main() -> None:
    p = harness.parser(__doc__)
    harness.vault(p)
    harness.device(p)
    p.add_argument("--tokens", type=int, default=96)
    harness.rounds(p, default=4)
    args = p.parse_args()
    every = Vault.open(args.vault).manifest.num_records
    rounds = []
    async with Engine.open(args.vault, slots=every, device=args.device) as engine:
        await fill_ring(engine)
        reference = resident_model(Vault.open(args.vault), engine.dtype)
        # A first round unrecorded: each side's first decode compiles kernels (MLX's CUDA
        # JIT) for shapes the others then find compiled; alternating rounds after it.
        for _ in range(args.rounds + 1):
            rounds.append(
                {
                    "runner_ms": await engine.debug.compute.run(
                        runner_ms, engine.debug.runner, args.tokens
                    ),
                    "engine_ms": await engine_ms(engine, args.tokens),
                    "mlx_lm_ms": await engine.debug.compute.run(mlx_lm_ms, reference, args.tokens),
                }
            )
        warm_up = rounds.pop(0)
        ours = await engine.debug.compute.run(engine_graph_cost, engine.debug.runner, args.tokens)

        def reference_cost() -> dict[str, Any]:
            cache = make_prompt_cache(reference)
            mx.eval(reference(mx.array([PROMPT]), cache=cache))
            return timed(reference, cache, args.tokens)

        theirs = await engine.debug.compute.run(reference_cost)
    medians = {k: round(statistics.median(r[k] for r in rounds), 3) for k in rounds[0]}
    harness.report(
        {
            "benchmark": "resident_overhead",
            "vault": args.vault,
            "device": args.device,
            "tokens": args.tokens,
            "warm_up_round": {k: round(v, 3) for k, v in warm_up.items()},
            "rounds": [{k: round(v, 3) for k, v in r.items()} for r in rounds],
            "median_ms_per_token": medians,
            "graph": {"engine": ours, "mlx_lm": theirs},
        },
        args,
    )


if __name__ == "__main__":
    smoe.util.loop.run(main())
