"""Options several commands take with the same meaning: declared once."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from smoe.errors import SmoeError
from smoe.util.sizes import parse_size

DTYPES = ("float32", "bfloat16", "float16")


def add_device(p: Any) -> None:
    """--device, as every command that computes takes it."""
    p.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        default=None,
        help="compute device (default: MLX's, the GPU where there is one)",
    )


def add_dtype(p: Any) -> None:
    """--dtype, the compute dtype."""
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="compute dtype (default float32 on CPU, bfloat16 on GPU)",
    )


def size_arg(text: str) -> int:
    """A size flag's value ('6GB', '512MiB', '0'): bytes, read once, here, as argparse
    reads the command line (a ``Size``: refusals quote the text). Argparse's usage error
    (exit 2, naming the flag) for text that is not a size."""
    try:
        return parse_size(text)
    except SmoeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def worker_count(text: str) -> int | None:
    """--workers: "auto" (None: the engine probes the disk) or a whole number (the engine
    refuses one outside 1..256 in its own one-line error, before any thread starts)."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give auto or a number, not {text!r}") from None


def add_workers(p: Any) -> None:
    """--workers, the I/O threads, as the run commands and the planner take it."""
    p.add_argument(
        "--workers",
        type=worker_count,
        default=None,
        metavar="auto|N",
        help="I/O threads (default auto: chosen for the disk by a short probe, cached; "
        "4 for a model under 1 GiB)",
    )


def add_host_memory(p: Any) -> None:
    """--host-memory: the host tier beside a GPU's ring (smoe.plan.host_tier)."""
    p.add_argument(
        "--host-memory",
        type=size_arg,
        default=None,
        metavar="SIZE",
        help="host RAM for copies of experts between a GPU's ring and the disk, e.g. 64GB "
        "(a miss it holds is copied over the bus instead of read; on top of --memory, which "
        "is the GPU's there; 0: none; default: half the available memory where the ring is "
        "in a discrete GPU's memory, else none; docs/cache-policy.md)",
    )


def add_model(p: Any, help: str, default: str) -> None:
    """MODEL, as the positional or as -m/--model (llama.cpp's -m, mlx-lm's and ollama's
    --model); ``settle_model`` makes them one ``args.vault``. A string here: the positional
    may turn out to be a prompt (``settle_generate``), which a Path would alter."""
    p.add_argument("vault", nargs="?", default=None, metavar="MODEL", help=f"{help} ({default})")
    p.add_argument(
        "-m",
        "--model",
        dest="model_flag",
        default=None,
        metavar="MODEL",
        help=f"MODEL as an option, as llama.cpp's -m and mlx-lm's --model take it ({default})",
    )


def settle_model(args: argparse.Namespace, parser: argparse.ArgumentParser, required: bool) -> None:
    """``args.vault`` from the positional or -m/--model (a Path, or None for the demo);
    argparse's usage error (exit 2) for both at once, or neither where one is ``required``."""
    if args.model_flag is not None:
        if args.vault is not None:
            parser.error(f"give the model once: {args.vault} or -m/--model {args.model_flag}")
        args.vault = args.model_flag
    if args.vault is None and required:
        parser.error("the following arguments are required: MODEL (or -m/--model MODEL)")
    args.vault = None if args.vault is None else Path(args.vault)


def settle_generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """`smoe generate MODEL "prompt"` (ollama run's shape) and `smoe generate -m MODEL
    "prompt"`: a positional prompt is --prompt's text; with -m, the one positional is it."""
    if args.model_flag is not None and args.vault is not None and args.prompt_text is None:
        args.prompt_text, args.vault = args.vault, None  # -m MODEL "prompt"
    settle_model(args, parser, required=True)
    if args.prompt_text is not None:
        if args.prompt is not None:
            parser.error("give the prompt once: as the second positional or as -p/--prompt")
        args.prompt = args.prompt_text


def settle_chat(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    settle_model(args, parser, required=False)


def usage_errors_name_the_command(parser: argparse.ArgumentParser) -> None:
    """Each subcommand's parser, at every depth, recorded in its own defaults
    (``args.command_parser``), so a usage error after parsing prints that command's usage,
    not the top-level one."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.set_defaults(command_parser=sub)
                usage_errors_name_the_command(sub)
