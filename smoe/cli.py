"""The `smoe` command line: the parser, the entry point and its exit codes. Each
subcommand is a thin shell over the Python API, in smoe.commands.

Exit codes as other command-line tools have them: 2 for a command line that cannot be
parsed (argparse prints the command's usage); 1 for a run that could not be done (a
SmoeError: a refusal or a failure, printed as one line naming the fix); Ctrl-C or SIGINT
exit 130 after the running command has cleaned up after itself, SIGTERM likewise with 0
for `smoe serve` (its normal end) and 143 for a command that did not finish; a second
signal during that cleanup exits at once (smoe.util.loop). SIGINT is handled however the
process was started: a shell starts a background job (`&`, `nohup`) with SIGINT ignored,
and `kill -INT` must still stop a backgrounded `smoe serve`.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import smoe.util.loop
from smoe.commands.bench import add_bench
from smoe.commands.chat import add_chat
from smoe.commands.generate import add_generate
from smoe.commands.options import usage_errors_name_the_command
from smoe.commands.plan import add_plan
from smoe.commands.serve import add_serve
from smoe.commands.vault import add_convert, add_export, add_inspect, add_shard, add_synth
from smoe.errors import SmoeError, Stopped


def _version() -> str:
    """'smoe 0.1.0 (mlx 0.32.4, mlx-lm 0.32.2)': what a bug report needs first."""
    from importlib.metadata import PackageNotFoundError, version

    from smoe import __version__

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"smoe {__version__} (mlx {of('mlx')}, mlx-lm {of('mlx-lm')})"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smoe",
        description="Run Mixture-of-Experts models larger than memory, streaming experts "
        "from an SSD vault, with output identical to running them in memory.",
    )
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_convert(sub)
    add_inspect(sub)
    add_synth(sub)
    add_generate(sub)
    add_chat(sub)
    add_serve(sub)
    add_bench(sub)
    add_export(sub)
    add_shard(sub)
    add_plan(sub)
    usage_errors_name_the_command(p)
    return p


def _terminate(signum: int, frame: Any) -> None:
    """SIGTERM outside an event loop (a synchronous command such as convert): Stopped is
    raised where the command runs, and its cleanups run on the way out. Inside one,
    smoe.util.loop's handler cancels the command's task instead."""
    raise Stopped()


@contextlib.contextmanager
def _interrupts_stop_the_command() -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt while a command runs, whatever
    dispositions the process inherited (an ignored SIGINT included); the caller's handlers
    come back afterwards, since ``main`` is also called in-process (tests, scripts)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; an embedding caller owns them
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminate)  # clean up on kill too
    try:
        with smoe.util.loop.signals():  # an event loop's command: smoe.util.loop's rules
            yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def _warnings_as_lines(command: str) -> Iterator[None]:
    """Warnings (ours say what was wrong and what was done, e.g. popularity counts that
    could not be kept) print as one line each, not with the source line Python adds,
    which reads as a traceback; the caller's warning settings come back afterwards."""

    def show(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> None:
        print(f"smoe {command}: warning: {message}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None and (code := _with_cpu_blas()) is not None:
        return code
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    args.argv = ["smoe", *argv]  # the command as typed (a benchmark's report records it)
    command_parser = getattr(args, "command_parser", parser)
    # `smoe bench policy` parses its own options (smoe.bench.policy): it gets the rest.
    if getattr(args, "passthrough", False):
        args.rest = rest
    elif rest:
        command_parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if getattr(args, "settle", None) is not None:  # what one flag or positional stands for
        args.settle(args, command_parser)
    if getattr(args, "memory", None) is not None:
        # --memory is the process's promise: bound what malloc keeps beside what is in
        # use before MLX, mlx-lm and the engine start threads (smoe.util.allocator).
        from smoe.util.allocator import bound_malloc

        bound_malloc()
    try:
        with _interrupts_stop_the_command(), _warnings_as_lines(args.command):
            return int(args.func(args))
    except SmoeError as e:
        print(f"smoe {args.command}: error: {e}", file=sys.stderr)
        if getattr(args, "json", False):  # a script reading --json output reads this too
            import json

            print(json.dumps({"error": str(e), "type": type(e).__name__, "exit_code": e.exit_code}))
        return e.exit_code
    except KeyboardInterrupt:
        print(f"smoe {args.command}: interrupted", file=sys.stderr)
        return 130
    except Stopped:  # SIGTERM: a server's normal end; any other command did not finish
        print(f"smoe {args.command}: stopped (SIGTERM)", file=sys.stderr)
        return 0 if args.command == "serve" else 143
    except BrokenPipeError:
        return 1


def _with_cpu_blas() -> int | None:
    """The ``smoe`` command with ``SMOE_CPU_BLAS`` set: re-executed once with that BLAS
    preloaded (smoe.util.blas; never returns). An exit code for a bad path; None where
    nothing is to do."""
    import os

    from smoe.util import blas

    try:
        again = blas.reexec_args(sys.argv[1:], dict(os.environ))
    except SmoeError as e:
        print(f"smoe: error: {e}", file=sys.stderr)
        return e.exit_code
    if again is None:
        return None
    args, env = again
    os.execve(args[0], args, env)


if __name__ == "__main__":
    sys.exit(main())
