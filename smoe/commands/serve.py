"""`smoe serve`: an HTTP server (OpenAI, Anthropic Messages and Ollama APIs) over one
engine, every check of its own flags made before the model loads."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import aiofiles.os

from smoe.commands.engine_flags import add_download_flag, add_engine_flags, add_warm_up_flag
from smoe.commands.engine_open import (
    choose_model,
    dtype_note,
    follow_rank0,
    open_engine,
    say_memory,
    warm_up,
)
from smoe.commands.options import add_model, settle_chat, size_arg
from smoe.errors import SmoeError


def cmd_serve(args: argparse.Namespace) -> int:
    from smoe.util.loop import run

    return run(_serve(args))


async def _serve(args: argparse.Namespace) -> int:
    from smoe.serve.app import serve
    from smoe.serve.intake import serve_reserve
    from smoe.serve.listener import base_urls

    _log_to_stderr(args.log_level)
    api_key, guard = await _checked_flags(args)  # before minutes of loading, not after
    model = choose_model(args)  # (its sampling checked before a download, and loading)
    options = _server_options(args, api_key, guard, model)
    reserve = serve_reserve(args.max_connections, args.request_memory)
    engine = open_engine(args, model.vault, max_batch=args.max_batch, host_reserve=reserve)
    async with engine:
        say_memory(engine, not engine.group.speaks)
        if await follow_rank0(engine):
            return 0
        await warm_up(engine, args)

        def ready(port: int) -> None:
            base = f"http://{args.host}:{port}"
            print(
                f"serving {model.vault} on {base} ({base_urls(base)}); "
                f"computing in {dtype_note(engine)}",
                file=sys.stderr,
            )

        await serve(engine, args.host, args.port, options, ready=ready)
    return 0


async def _checked_flags(args: argparse.Namespace) -> tuple[str | None, Any]:
    """The API key and the Host/Origin guard (``serve_guard``), after every check of the
    server's own flags that needs no model: SmoeError naming the flag (the port taken,
    limits out of range, a --prefix-cache-dir that is a file, too little --request-memory)."""
    from smoe.serve.intake import MIN_REQUEST_MEMORY

    api_key, guard = serve_guard(args)
    check_port_free(args.host, args.port)
    if not guard.loopback_only and not api_key:
        print(f"warning: serving on {args.host} without an API key", file=sys.stderr)
    if not args.idle_timeout > 0 or args.max_connections < 1:
        raise SmoeError("--idle-timeout must be above 0 and --max-connections at least 1")
    if (args.max_batch is not None and args.max_batch < 1) or args.max_queue < 0:
        raise SmoeError("--max-batch must be at least 1 and --max-queue at least 0")
    prefix_dir = args.prefix_cache_dir
    if prefix_dir is not None and await aiofiles.os.path.isfile(prefix_dir):
        raise SmoeError(f"--prefix-cache-dir {prefix_dir} is a file; name a directory")
    if args.request_memory < MIN_REQUEST_MEMORY:
        raise SmoeError(
            f"--request-memory must be at least {MIN_REQUEST_MEMORY // 2**20}MiB (a large "
            "body arriving and one request's preparation)"
        )
    return api_key, guard


def _server_options(args: argparse.Namespace, api_key: str | None, guard: Any, model: Any) -> Any:
    """The server's options from its flags (sizes already bytes: argparse read them)."""
    from smoe.serve.app import ServerOptions

    prefix_dir = args.prefix_cache_dir
    return ServerOptions(
        api_key=api_key,
        guard=guard,
        idle_timeout_s=args.idle_timeout,
        max_connections=args.max_connections,
        max_queue=args.max_queue,
        model_name=Path(model.vault).name,
        temperature=model.temperature,
        top_p=model.top_p,
        max_tokens=args.max_tokens if args.max_tokens is not None else 256,
        prewarm_when_idle=args.prewarm,
        cached_bytes=args.prefix_cache,
        prefix_dir=None if prefix_dir is None else Path(prefix_dir),
        prefix_dir_bytes=args.prefix_cache_disk,
        request_memory=args.request_memory,
    )


def check_serve_address(port: int, api_key: str | None) -> None:
    """Refuse what the OS or the server would silently change (SmoeError naming the fix):
    a port outside 0..65535 (the kernel keeps its low 16 bits: 70000 served on 4464), and
    an empty --api-key (no key would be asked at all)."""
    if not 0 <= port <= 65535:
        raise SmoeError(f"--port {port} is not a TCP port; give 1-65535 (0: any free port)")
    if api_key is not None and not api_key.strip():
        raise SmoeError("--api-key is empty, which would ask no key at all; give a key or drop it")


def serve_guard(args: argparse.Namespace) -> tuple[str | None, Any]:
    """The API key (--api-key, --api-key-file or $SMOE_API_KEY) and the Host/Origin rules
    for the bind address (smoe/serve/guard.py), checked before loading."""
    from smoe.serve.guard import Guard, resolve_api_key

    check_serve_address(args.port, args.api_key)
    key = resolve_api_key(args.api_key, args.api_key_file)
    return key, Guard.for_bind(args.host, args.allow_host, args.allow_origin)


def check_port_free(host: str, port: int) -> None:
    """SmoeError naming the fix if ``host``:``port`` cannot be listened on now (the server
    binds again once loaded; this only saves a user the loading time)."""
    import socket

    from smoe.serve.app import bind_failure

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise SmoeError(f"cannot resolve --host {host} ({e}); give an address or a name") from e
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds
        try:
            probe.bind(address)
        except OSError as e:
            raise SmoeError(bind_failure(host, port, e)) from e


def _log_to_stderr(level: str) -> None:
    """The server's log (a line per request on smoe.serve.access, failures) on stderr at
    ``level``; other libraries' loggers stay at WARNING."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.set_name("smoe-stderr")
    serve_log = logging.getLogger("smoe.serve")
    serve_log.setLevel(level.upper())
    for old in [h for h in serve_log.handlers if h.get_name() == "smoe-stderr"]:
        serve_log.removeHandler(old)  # (main may run again in one process)
    serve_log.addHandler(handler)
    serve_log.propagate = False  # one line each, whatever the root logger does


def add_serve(sub: Any) -> None:
    """`smoe serve` and its options."""
    sv = sub.add_parser("serve", help="an HTTP server: OpenAI, Anthropic Messages and Ollama APIs")
    add_model(  # llama-server's -m, as generate and chat take it
        sv,
        help="a vault, or a downloaded checkpoint folder",
        default="default: the built-in demo",
    )
    sv.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    sv.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: any free)")
    sv.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (default: none, no key asked; seen in "
        "ps: prefer --api-key-file or $SMOE_API_KEY)",
    )
    sv.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help="read the API key from this file's first line (default: none; then "
        "$SMOE_API_KEY if set)",
    )
    sv.add_argument(
        "--allow-host",
        action="append",
        default=None,
        metavar="NAME",
        help="on a loopback bind, also answer requests for this Host name (repeatable; "
        "default: loopback names only, against DNS rebinding)",
    )
    sv.add_argument(
        "--allow-origin",
        action="append",
        default=None,
        metavar="ORIGIN",
        help="let browser requests from this web origin in, e.g. http://localhost:3000 "
        "(repeatable; '*': any; default: the server's own names only)",
    )
    sv.add_argument(
        "--idle-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="close a connection idle this long: nothing sent, a request head that does not "
        "end, or between requests (default 30)",
    )
    sv.add_argument(
        "--max-connections",
        type=int,
        default=128,
        help="connections open at once; past it a new one gets 503 (default 128; each is "
        "counted in --memory: 256 KiB of buffers)",
    )
    sv.add_argument(
        "--request-memory",
        type=size_arg,
        default="64MiB",
        metavar="SIZE",
        help="memory for request bodies arriving and requests being prepared, counted in "
        "--memory: half for large bodies arriving (past it 503), half the most one "
        "request's parsing or tokenizing may take (past it 413) (default 64MiB)",
    )
    sv.add_argument(
        "--max-queue",
        type=int,
        default=16,
        help="requests that may wait for a place in the batch; more get 429 (default 16)",
    )
    sv.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="requests decoded together, one token each per step (default 8; each gets "
        "the tokens it gets alone, on a GPU too: docs/gpu.md)",
    )
    sv.add_argument(
        "--prefix-cache",
        type=size_arg,
        default="2GB",
        help="memory for the KV caches kept for prefix reuse (last 8 requests; 0: off; "
        "default 2GB)",
    )
    sv.add_argument(
        "--prefix-cache-dir",
        metavar="DIR",
        help="keep long prompts' KV caches (256 tokens or more) in DIR, so that a restarted "
        "server does not prefill a repeated long prompt again (checksummed; another model's "
        "or a damaged entry is ignored; default: none, nothing kept on disk)",
    )
    sv.add_argument(
        "--prefix-cache-disk",
        type=size_arg,
        default="8GB",
        metavar="SIZE",
        help="the most this model's entries in --prefix-cache-dir take (least recently used "
        "go first; default 8GB)",
    )
    sv.add_argument(
        "--no-prewarm",
        dest="prewarm",
        action="store_false",
        help="do not read the historically hottest experts into empty slots when idle",
    )
    sv.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="info: a line per request (method, path, status, time, tokens; never a key or "
        "a prompt); warning: failures only; debug: also malformed HTTP (default info)",
    )
    sv.add_argument(
        "--temp",
        type=float,
        default=None,
        help="temperature of a request that sets none (default: the model's "
        "generation_config, else 0: greedy)",
    )
    sv.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="top_p of a request that sets none (default: the model's generation_config, "
        "else 1.0: all)",
    )
    sv.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="reply tokens of a request that sets none (default 256, at most the context)",
    )
    add_warm_up_flag(sv)
    add_download_flag(sv)
    add_engine_flags(sv)
    sv.set_defaults(func=cmd_serve, settle=settle_chat)  # (MODEL optional, as in chat)
