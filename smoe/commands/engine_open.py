"""Opening an engine for `smoe generate`, `chat` and `serve`, written once: the model the
command names (chat and serve: or the built-in demo) with the sampling its authors
suggest, the engine with the options its flags give, and the lines it says on stderr as
it starts (how --memory divided, the ranks, the kernels' warm-up)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from smoe.errors import SmoeError
from smoe.vault.hub import resolve_model

if TYPE_CHECKING:
    from smoe.engine import Engine


def open_engine(args: argparse.Namespace, vault: Any, **overrides: Any) -> Engine:
    """An engine on ``vault`` (not started: use ``async with``) with the options the
    engine flags give (smoe.commands.engine_flags; EngineOptions.from_args), ``overrides``
    a command's own (generate's max_batch=1). SmoeError for a bad option, before the model
    is opened; otherwise what Engine.open raises."""
    from smoe.engine import Engine
    from smoe.plan.options import EngineOptions

    return Engine(vault, EngineOptions.from_args(args, **overrides))


@dataclass(frozen=True)
class ChosenModel:
    """The model `smoe chat` or `smoe serve` runs, and the sampling it gets by default."""

    vault: Any  # a vault or checkpoint folder (resolved from a Hub name), or the demo
    temperature: float  # --temp, else the model's suggestion, else 0 (greedy)
    top_p: float  # --top-p, likewise (else 1.0)
    origin: str  # where the suggestion came from, in words (chat's start line)


def choose_model(args: argparse.Namespace) -> ChosenModel:
    """The model named (a folder, or a Hub name: smoe.vault.hub), else the built-in demo
    (made on first use); and the sampling where the flags set none: the model's
    generation_config.json, else greedy. SmoeError naming the flag for a sampling setting
    no reply could use: the flags alone before a download or the demo's first-run
    conversion, then with the model's suggestion filled in."""
    from smoe.chat.sampling import sampling_and_origin

    check_sampling_flags(args)
    vault = None if args.vault is None else resolve_model(args.vault, download=args.download)
    if vault is None:
        from smoe.chat.demo import demo_vault

        vault = demo_vault(progress=lambda msg: print(msg, file=sys.stderr))
    suggested, origin = sampling_and_origin(Path(vault))  # generation_config's, else greedy
    temperature = suggested["temperature"] if args.temp is None else args.temp
    top_p = suggested["top_p"] if args.top_p is None else args.top_p
    check_sampling(temperature, top_p, args.max_tokens)  # before loading, not every turn
    return ChosenModel(vault, temperature, top_p, origin)


def check_sampling_flags(args: argparse.Namespace) -> None:
    """``check_sampling`` of the flags given, each alone (the model's suggestions fill the
    others once it is found)."""
    temperature = 0.0 if args.temp is None else args.temp
    check_sampling(temperature, 1.0 if args.top_p is None else args.top_p, args.max_tokens)


def check_sampling(temperature: float, top_p: float, max_tokens: int | None) -> None:
    """SmoeError naming the flag for a sampling setting no reply could use."""
    from smoe.sampling import SamplingParams

    if max_tokens is not None and max_tokens < 1:
        raise SmoeError("--max-tokens must be at least 1")
    try:
        SamplingParams(temperature=temperature, top_p=top_p).check()
    except SmoeError as e:
        raise SmoeError(f"{e} (--temp, --top-p)") from None


def say_memory(engine: Any, quiet: bool) -> None:
    """How --memory divided (smoe.plan.budget.Fit.line), the host tier and, where the disk
    was probed, how many I/O workers it got: a line each on stderr (none if ``quiet``)."""
    if quiet:
        return
    for line in engine.start_lines:  # the budget's division, the host tier, the workers
        print(line, file=sys.stderr)


async def follow_rank0(engine: Any) -> bool:
    """Chat and serve across ranks: rank 0 leads (it hears the users) and this returns
    False; another rank runs rank 0's requests until it ends, then this returns True."""
    group = engine.group
    if not group.distributed:
        return False
    if group.rank == 0:
        await group.lead()
        return False
    print(f"rank {group.rank} of {group.size}: following rank 0", file=sys.stderr)
    await group.follow()
    return True


async def warm_up(engine: Any, args: argparse.Namespace, **sampling: Any) -> None:
    """Engine.learning.warm_up, shown as one line on stderr; not on ranks (rank 0 drives them)."""
    if not args.warm_up or engine.group.distributed:
        return
    print("warming up the kernels ... ", end="", file=sys.stderr, flush=True)
    seconds = await engine.learning.warm_up(**sampling)
    print(f"{seconds:.1f} s", file=sys.stderr)


def dtype_note(engine: Any) -> str:
    """The compute dtype and why (smoe.compute.model.compute_dtype_note), and whose
    kernels compute in it (smoe.compute.native.arithmetic)."""
    now = engine.stats()
    return f"{now.compute_dtype_note} by {now.arithmetic}"
