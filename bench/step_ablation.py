"""Which part of a resident decode step costs the engine more host time than mlx-lm: the
same greedy decode, built one ahead, run four ways on the compute thread of one engine,
in alternating rounds:

- ``runner/engine``: ``Runner.step`` on the engine's model (what a user gets);
- ``runner/mlx_lm``: ``Runner.step`` on mlx-lm's model with the same weights in memory;
- ``loop/engine`` and ``loop/mlx_lm``: a bare generate_step-shaped loop (argmax, no
  logsumexp, no routing counts) on each model.

runner/mlx_lm against loop/mlx_lm is the runner's own cost; runner/engine against
runner/mlx_lm is the engine's model (streamed layers over the ring, routing counted);
each row splits a token's host time into build, queue (async_eval) and wait (medians, ms).

    python bench/step_ablation.py VAULT [--device gpu] [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import harness
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import smoe.util.loop
from smoe.bench.resident import fill_ring
from smoe.compute.model import resident_model
from smoe.compute.runner import Runner
from smoe.engine import Engine
from smoe.sampling import SamplingParams
from smoe.vault.format import Vault

PROMPT = [5, 17, 99, 300, 42, 7, 250, 600]


def runner_loop(runner: Runner, tokens: int) -> dict[str, float]:
    """Runner.step built ahead: the runner's own timeline, medians (ms)."""
    seq = runner.start(PROMPT, SamplingParams())
    runner.step(seq)
    runner.timeline.clear()
    for i in range(tokens):
        runner.step(seq, more=i < tokens - 1)
    s = runner.timeline.summary()["by_rows"]["1"]
    return {k: s[f"{k}_ms"] for k in ("build", "queue", "wait", "period")}


def bare_loop(model: Any, tracer: Any, tokens: int) -> dict[str, float]:
    """generate_step's shape with nothing else: token n+1 built and queued before token n
    is read. ``tracer``: the engine's, whose deferred routing is dropped each token."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([PROMPT]), cache=cache))
    parts: dict[str, list[float]] = {"build": [], "queue": [], "wait": [], "period": []}
    y = mx.argmax(model(mx.array([[17]]), cache=cache)[:, -1, :], axis=-1)
    mx.async_eval(y)
    for _ in range(tokens):
        t0 = time.perf_counter()
        nxt = mx.argmax(model(y[None], cache=cache)[:, -1, :], axis=-1)
        if tracer is not None:
            tracer.step.deferred.clear()
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        y.item()
        t3 = time.perf_counter()
        for name, s in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
            parts[name].append(s * 1e3)
        y = nxt
    mx.eval(y)
    return {k: round(statistics.median(v), 3) for k, v in parts.items()}


async def main() -> None:
    p = harness.parser(__doc__)
    harness.vault(p)
    harness.device(p)
    p.add_argument("--tokens", type=int, default=64)
    harness.rounds(p, default=3)
    args = p.parse_args()
    every = Vault.open(args.vault).manifest.num_records
    async with Engine.open(args.vault, slots=every, device=args.device) as engine:
        await fill_ring(engine)
        parts = engine.debug
        reference = resident_model(Vault.open(args.vault), engine.dtype)
        theirs = Runner(reference, resident=lambda: True)
        ways = {
            "runner/engine": lambda: runner_loop(parts.runner, args.tokens),
            "runner/mlx_lm": lambda: runner_loop(theirs, args.tokens),
            "loop/engine": lambda: bare_loop(parts.runner.model, parts.tracer, args.tokens),
            "loop/mlx_lm": lambda: bare_loop(reference, None, args.tokens),
        }
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds + 1):  # the first round compiles kernels: not kept
            order = list(ways) if r % 2 == 0 else list(reversed(ways))
            got = {name: await parts.compute.run(ways[name]) for name in order}
            if r:
                rounds.append(got)
    medians = {
        name: {
            k: round(statistics.median(rd[name][k] for rd in rounds), 3) for k in rounds[0][name]
        }
        for name in ways
    }
    harness.report(
        {
            "benchmark": "step_ablation",
            "vault": args.vault,
            "device": args.device,
            "tokens": args.tokens,
            "rounds": rounds,
            "median_ms": medians,
        },
        args,
    )


if __name__ == "__main__":
    smoe.util.loop.run(main())
