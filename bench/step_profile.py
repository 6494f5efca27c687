"""Where a streamed decode step's time goes, by part, on the compute thread (issue 27).

    python bench/step_profile.py VAULT [--memory 100%] [--device gpu] [--steps 40]

Opens the engine with the given ring, generates once (the ring then holds what a session
would), and profiles ``--steps`` decode steps of a second prompt on the compute thread with
cProfile. Prints JSON: milliseconds per step in each part, and per MoE layer call:
- ``routing_read``: reading the router's top-k back to the host (evaluates the layer up to
  its router: attention and the rest are computed here on a lazy backend);
- ``expert_compute``: the expert matmuls on ring slots, evaluated before the slots go back;
- ``slots_wait``: waiting for the event loop to hand out slots (reads, hops);
- ``lookahead`` and ``observe``: next-layer prediction and the routing's bookkeeping;
- ``rest``: the step's remainder (the last evaluation, the LM head, sampling, Python).
The parts are cProfile's cumulative times of the functions named in PARTS; profiling adds
its own overhead, so compare parts, not the total, with an unprofiled run.
"""

from __future__ import annotations

import cProfile
import pstats
import time

import harness

import smoe.util.loop
from smoe.bench.generate import random_prompt, ring_options
from smoe.engine import Engine
from smoe.sampling import SamplingParams
from smoe.vault.format import Vault

# part -> (file suffix, function name) whose cumulative time it is
PARTS = {
    "expert_compute": ("smoe/compute/streaming.py", "_compute"),
    "lookahead": ("smoe/compute/speculation.py", "look_ahead"),
    "observe": ("smoe/compute/streaming.py", "_observe"),
    "slots_wait": ("smoe/compute/worker.py", "_wait"),
    "moe_layer": ("smoe/compute/streaming.py", "__call__"),
}


def profile_steps(runner, prompt: list[int], steps: int) -> tuple[float, dict]:
    seq = runner.start(prompt, SamplingParams())
    for _ in range(3):  # compiled kernels, a settled ring
        runner.step(seq)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        runner.step(seq)
    profiler.disable()
    wall = time.perf_counter() - start
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    return wall, stats


def parts_of(stats: dict, steps: int) -> dict[str, float]:
    out: dict[str, float] = {}
    calls = 0
    for (file, _, name), (_, ncalls, _, cumtime, callers) in stats.items():
        for part, (suffix, fn) in PARTS.items():
            if file.endswith(suffix) and name == fn:
                out[part] = out.get(part, 0.0) + cumtime
                if part == "moe_layer":
                    calls += ncalls
        if name == "<built-in method numpy.array>":
            # The MoE layer's own read of its routing (not lookahead's or observe's).
            for (cfile, _, cname), (_, _, _, ct) in callers.items():
                if cfile.endswith("smoe/compute/streaming.py") and cname == "__call__":
                    out["routing_read"] = out.get("routing_read", 0.0) + ct
    ms = {k: round(v / steps * 1e3, 3) for k, v in out.items()}
    ms["moe_calls_per_step"] = round(calls / steps, 2)
    return ms


async def main() -> None:
    p = harness.parser(__doc__)
    harness.vault(p)
    harness.memory(p, ring=True, default="100%")
    harness.device(p)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompt-tokens", type=int, default=8)
    args = p.parse_args()
    vault = Vault.open(args.vault)
    first = random_prompt(vault, args.prompt_tokens, 0)
    second = random_prompt(vault, args.prompt_tokens, 1)
    ring = ring_options(args.vault, args.memory)
    async with Engine.open(args.vault, device=args.device, **ring) as engine:
        async for _ in engine.generate(first, max_tokens=32, stop_at_eos=False):
            pass
        wall, stats = await engine.debug.compute.run(
            profile_steps, engine.debug.runner, second, args.steps
        )
        resident = engine.debug.runner.resident is not None and engine.debug.runner.resident()
    parts = parts_of(stats, args.steps)
    harness.report(
        {
            "benchmark": "step_profile",
            "vault": args.vault,
            "memory": args.memory,
            "device": args.device,
            "resident": resident,
            "profiled_ms_per_step": round(wall / args.steps * 1e3, 3),
            "parts_ms_per_step": parts,
        },
        args,
    )


if __name__ == "__main__":
    smoe.util.loop.run(main())
