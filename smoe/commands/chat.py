"""`smoe chat`: a conversation with a model (the built-in demo without MODEL), in the
terminal, or a line per message when piped."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from smoe.commands.engine_flags import (
    add_download_flag,
    add_engine_flags,
    add_seed_flag,
    add_verbose_flag,
    add_warm_up_flag,
)
from smoe.commands.engine_open import (
    choose_model,
    dtype_note,
    follow_rank0,
    open_engine,
    say_memory,
    warm_up,
)
from smoe.commands.options import add_model, settle_chat


def cmd_chat(args: argparse.Namespace) -> int:
    from smoe.util.loop import run

    return run(_chat(args))


async def _chat(args: argparse.Namespace) -> int:
    import time

    from smoe.chat.repl import ChatApp, history_file

    start = time.perf_counter()
    model = choose_model(args)  # (its sampling checked before a download, and loading)
    temperature, top_p = model.temperature, model.top_p
    async with open_engine(args, model.vault, max_batch=1) as engine:
        say_memory(engine, not engine.group.speaks)
        if await follow_rank0(engine):
            return 0
        chosen = f" ({model.origin})" if args.temp is None and args.top_p is None else ""
        # At temperature 0 the likeliest token is taken: top_p plays no part then.
        how = f", top_p {top_p:g}" if temperature else ("" if chosen else " (greedy)")
        print(
            f"loaded {model.vault} in {time.perf_counter() - start:.1f} s; computing in "
            f"{dtype_note(engine)}; sampling at temperature {temperature:g}{how}{chosen}",
            file=sys.stderr,
        )
        await warm_up(engine, args, temperature=temperature, top_p=top_p, seed=args.seed)
        app = ChatApp(
            engine,
            engine.conversation(system=args.system),
            history=history_file(),
            sampling={
                "max_tokens": args.max_tokens,
                "temperature": temperature,
                "top_p": top_p,
                "seed": args.seed,
            },
        )
        if sys.stdin.isatty():
            await app.run()
        else:  # piped: a line per message, without the terminal's prompt and status bar
            await app.run_lines(sys.stdin)
    return 0


def add_chat(sub: Any) -> None:
    """`smoe chat` and its options."""
    ch = sub.add_parser("chat", help="chat with a model (the built-in demo without MODEL)")
    add_model(
        ch,
        help="a vault, a downloaded checkpoint folder, or a Hub name (org/name) in the "
        "Hugging Face cache",
        default="default: the built-in demo, made on first use",
    )
    ch.add_argument(
        "--system", "--system-prompt", default=None, help="system prompt (default: none)"
    )
    ch.add_argument(
        "-n", "--max-tokens", type=int, default=256, help="most tokens per reply (default 256)"
    )
    ch.add_argument(
        "--temp",
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature (default: the model's generation_config, else 0: greedy)",
    )
    ch.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="sample from the smallest set of tokens whose probabilities reach P (default: "
        "the model's generation_config, else 1.0: all)",
    )
    add_seed_flag(ch)
    add_warm_up_flag(ch)
    add_verbose_flag(ch)
    add_download_flag(ch)
    add_engine_flags(ch)
    ch.set_defaults(func=cmd_chat, settle=settle_chat)
