"""`smoe generate`: one prompt (text through the chat template, or token ids), one reply,
streamed on stdout (or one JSON object), with a summary line on stderr."""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from pathlib import Path
from typing import Any

from smoe.commands.engine_flags import (
    add_download_flag,
    add_engine_flags,
    add_seed_flag,
    add_verbose_flag,
)
from smoe.commands.engine_open import open_engine, say_memory
from smoe.commands.options import add_model, settle_generate
from smoe.errors import SmoeError
from smoe.util import blas
from smoe.vault.hub import resolve_model


def _id_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids like 1,2,3, got '{text}'") from None


def cmd_generate(args: argparse.Namespace) -> int:
    from smoe.util.loop import run

    return run(_generate(args))


async def _generate(args: argparse.Namespace) -> int:
    import anyio

    if (args.prompt is None) == (args.prompt_ids is None):
        raise SmoeError(
            'give exactly one of --prompt TEXT (or -p TEXT, or MODEL "TEXT") or --prompt-ids 1,2,3'
        )
    if args.prompt_ids is not None and args.system_prompt is not None:
        raise SmoeError("--system-prompt goes with --prompt TEXT (the chat template), not ids")
    text = sys.stdin.read() if args.prompt == "-" else args.prompt  # "-": mlx-lm's stdin
    # One sequence: the memory budget keeps KV room for one (smoe.plan.budget).
    vault = resolve_model(args.vault, download=args.download)  # a folder, or a Hub name
    async with open_engine(args, vault, max_batch=1) as engine:
        quiet = not engine.group.speaks  # rank 0 talks to the user
        prompt, templated = _generate_prompt(engine, text, args)
        say_memory(engine, quiet)
        preload_s = await engine.learning.load_all() if args.preload else None
        if engine.group.distributed and args.temp > 0 and args.seed is None:
            args.seed = await engine.group.from_rank0(
                secrets.randbits(31)
            )  # every rank samples alike
        if args.routing_archive:
            engine.learning.start_recording(args.archive_depth)
        tokens, pieces, stats, finish = await _stream_reply(engine, prompt, args, quiet)
        now = engine.stats()
        stats["scheduler"] = now.scheduler.to_json()  # queue waits, read latencies
        stats["ring_slots"] = now.ring.slots
        stats["compute_dtype_note"] = now.compute_dtype_note  # what "equal to mlx-lm" assumes
        stats["arithmetic"] = now.arithmetic  # whose kernels (smoe.compute.native)
        if preload_s is not None:
            stats["preload_s"] = preload_s  # --preload: every expert read before the prompt
        stats["cpu_blas"] = blas.in_use()  # MLX's bundled BLAS, or SMOE_CPU_BLAS's
        stats["ring_bytes"] = now.ring.nbytes
        stats["slot_bytes"] = now.ring.slot_bytes  # the slot plan and the start line print
        if now.draft is not None:
            stats["draft"] = now.draft  # passes, acceptance
        if args.routing_archive:
            archive = engine.learning.stop_recording()  # compressed and fsynced off the event loop
            saved = await anyio.to_thread.run_sync(archive.save, args.routing_archive)
            stats["routing_archive"] = str(saved)
        if engine.group.distributed:
            stats["ranks"] = await engine.group.rank_stats()  # each rank's I/O, gathered
    if not quiet:
        _print_generated(tokens, pieces, stats, finish, as_json=args.json)
        if not tokens and finish == "stop" and not args.json:
            print(_why_nothing(templated, args), file=sys.stderr)
    return 0


def _generate_prompt(engine: Any, text: str | None, args: argparse.Namespace) -> tuple[Any, bool]:
    """The prompt `smoe generate` runs, and whether the chat template made it: --prompt
    text goes through the model's chat template (with --system-prompt), as mlx-lm's
    generate does, unless --ignore-chat-template or the model has none; ids go as given."""
    if text is None:
        return args.prompt_ids, False
    tok = engine.tokenizer
    has_template = tok is not None and getattr(tok, "chat_template", None) is not None
    if args.ignore_chat_template or not has_template:
        if args.system_prompt is not None:
            raise SmoeError(
                "--system-prompt needs the chat template: "
                + ("drop --ignore-chat-template" if has_template else "this model has none")
            )
        return text, False
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    messages.append({"role": "user", "content": text})
    return engine.conversation().template(messages), True


def _why_nothing(templated: bool, args: argparse.Namespace) -> str:
    """One line for a generation that ended before its first token (an end token first)."""
    if templated:
        return "(the model ended its reply at once: its end-of-sequence token came first)"
    fix = (
        "drop --ignore-chat-template to send it as a chat message"
        if args.ignore_chat_template
        else "this model has no chat template: give it text to continue"
    )
    return f"(the model ended at once: its end-of-sequence token came first; {fix})"


async def _stream_reply(
    engine: Any, prompt: Any, args: argparse.Namespace, quiet: bool = False
) -> tuple[list[int], list[str], dict[str, Any], str | None]:
    """Generate with the command's sampling options, printing the text as it comes unless
    --json; return the tokens, the text pieces, the stats and the finish reason."""
    tokens: list[int] = []
    text: list[str] = []
    stats: dict[str, Any] = {}
    finish = None
    async for event in engine.generate(
        prompt,
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    ):
        if event.token is not None:
            tokens.append(event.token)
        if event.text:
            text.append(event.text)
            if not args.json and not quiet:
                print(event.text, end="", flush=True)
        if event.stats is not None:
            stats, finish = event.stats.to_json(), event.finish_reason
    return tokens, text, stats, finish


def _print_generated(
    tokens: list[int], text: list[str], stats: dict[str, Any], finish: str | None, as_json: bool
) -> None:
    """`smoe generate`'s result: one JSON object on stdout, or a summary line on stderr
    after the streamed text."""
    from smoe.util.sizes import format_bytes

    if as_json:
        print(
            json.dumps(
                {"tokens": tokens, "text": "".join(text), "finish_reason": finish, "stats": stats}
            )
        )
    else:
        print()
        bus = stats.get("bus_bytes", 0)
        bus_note = f" + {format_bytes(bus)} from the host tier" if bus else ""
        print(
            f"[{len(tokens)} tokens, {finish}; first token {stats['ttft_s']:.2f} s, "
            f"prefill {stats['prefill_tok_s']:.1f} tok/s, decode {stats['decode_tok_s']:.2f} "
            f"tok/s, read {format_bytes(stats['bytes_read'])}{bus_note}, hit rate "
            f"{100 * stats['hit_rate']:.0f}%; computed in {stats['compute_dtype_note']} by "
            f"{stats['arithmetic']}]",
            file=sys.stderr,
        )


def add_generate(sub: Any) -> None:
    """`smoe generate` and its options."""
    g = sub.add_parser("generate", help="generate text from a prompt, streaming experts")
    add_model(
        g,
        help="a vault, a downloaded checkpoint folder, or a Hub name (org/name) in the "
        "Hugging Face cache",
        default="no default: this or -m",
    )
    g.add_argument(
        "prompt_text",
        nargs="?",
        default=None,
        metavar="PROMPT",
        help="the prompt, as ollama run takes it: the same as --prompt (no default: this, "
        "--prompt or --prompt-ids)",
    )
    g.add_argument(
        "-p",
        "--prompt",
        default=None,
        help="prompt text, sent through the model's chat template as a user message (as "
        "mlx-lm does); - reads it from standard input (no default: this, PROMPT or "
        "--prompt-ids)",
    )
    g.add_argument(
        "--prompt-ids",
        type=_id_list,
        default=None,
        help="prompt token ids, as given: 1,2,3 (no default: this or --prompt)",
    )
    g.add_argument(
        "--system-prompt", default=None, help="a system message before the prompt (default: none)"
    )
    g.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="tokenize the prompt text as it is, without the chat template",
    )
    g.add_argument(
        "-n",
        "--max-tokens",
        type=int,
        default=128,
        help="most tokens to generate (default 128)",
    )
    g.add_argument(
        "--temp",
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature (default 0: greedy)",
    )
    g.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample from the smallest set of tokens whose probabilities reach P "
        "(default 1.0: all)",
    )
    g.add_argument(
        "--top-k", type=int, default=0, help="sample from the K likeliest tokens (default 0: all)"
    )
    g.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="drop tokens less likely than P x the likeliest's (default 0.0: none)",
    )
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="penalize tokens already in the context, as mlx-lm does (default 1.0: none)",
    )
    add_seed_flag(g)
    g.add_argument(
        "--json",
        action="store_true",
        help='print one JSON object with "tokens", "text" and "stats"',
    )
    g.add_argument(
        "--preload",
        action="store_true",
        help="read every expert into memory before the prompt, as mlx-lm and llama.cpp load "
        "a model first (needs a ring that holds them all; default: read each on first use)",
    )
    g.add_argument(
        "--routing-archive",
        type=Path,
        default=None,
        help="record every routing decision (with deeper gate ranks) to this .npz (default: none)",
    )
    g.add_argument(
        "--archive-depth",
        type=int,
        default=16,
        help="with --routing-archive: gate ranks kept per decision (default 16)",
    )
    add_verbose_flag(g)
    add_download_flag(g)
    add_engine_flags(g)
    g.set_defaults(func=cmd_generate, settle=settle_generate)
