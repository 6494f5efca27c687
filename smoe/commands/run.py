"""`smoe generate`, `smoe chat` and `smoe serve`: the commands that open an Engine on a
vault, and the engine options (--memory, --slots, --policy ...) the three share."""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from pathlib import Path
from typing import Any

import aiofiles.os

from smoe.commands.options import (
    add_device,
    add_dtype,
    add_host_memory,
    add_model,
    add_workers,
    settle_chat,
    settle_generate,
)
from smoe.errors import SmoeError
from smoe.plan.budget import KV_BITS
from smoe.util import blas
from smoe.util.sizes import parse_size
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

    from smoe.engine import Engine

    if (args.prompt is None) == (args.prompt_ids is None):
        raise SmoeError(
            'give exactly one of --prompt TEXT (or -p TEXT, or MODEL "TEXT") or --prompt-ids 1,2,3'
        )
    if args.prompt_ids is not None and args.system_prompt is not None:
        raise SmoeError("--system-prompt goes with --prompt TEXT (the chat template), not ids")
    text = sys.stdin.read() if args.prompt == "-" else args.prompt  # "-": mlx-lm's stdin
    # One sequence: the memory budget keeps KV room for one (smoe.plan.budget).
    vault = resolve_model(args.vault, download=args.download)  # a folder, or a Hub name
    async with Engine.open(vault, **_engine_options(args), max_batch=1) as engine:
        quiet = not engine.speaks  # rank 0 talks to the user
        prompt, templated = _generate_prompt(engine, text, args)
        _say_memory(engine, quiet)
        preload_s = await engine.load_all() if args.preload else None
        if engine.ranks is not None and args.temp > 0 and args.seed is None:
            args.seed = await engine.from_rank0(secrets.randbits(31))  # every rank samples alike
        if args.routing_archive:
            engine.start_recording(args.archive_depth)
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
            archive = engine.stop_recording()  # compressed and fsynced off the event loop
            saved = await anyio.to_thread.run_sync(archive.save, args.routing_archive)
            stats["routing_archive"] = str(saved)
        if engine.ranks is not None:
            stats["ranks"] = await engine.rank_stats()  # each rank's I/O, gathered
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


def _dtype_note(engine: Any) -> str:
    """The compute dtype and why (smoe.compute.model.compute_dtype_note), and whose
    kernels compute in it (smoe.compute.native.arithmetic)."""
    now = engine.stats()
    return f"{now.compute_dtype_note} by {now.arithmetic}"


def cmd_chat(args: argparse.Namespace) -> int:
    from smoe.util.loop import run

    return run(_chat(args))


async def _chat(args: argparse.Namespace) -> int:
    import time

    from smoe.chat.demo import demo_vault
    from smoe.chat.repl import ChatApp, history_file
    from smoe.chat.sampling import sampling_and_origin
    from smoe.engine import Engine

    start = time.perf_counter()
    _check_sampling_flags(args)  # before a download or the demo's first-run conversion
    vault = None if args.vault is None else resolve_model(args.vault, download=args.download)
    if vault is None:
        vault = demo_vault(progress=lambda msg: print(msg, file=sys.stderr))
    suggested, origin = sampling_and_origin(Path(vault))  # generation_config's, else greedy
    temperature = suggested["temperature"] if args.temp is None else args.temp
    top_p = suggested["top_p"] if args.top_p is None else args.top_p
    _check_sampling(temperature, top_p, args.max_tokens)  # before loading, not every turn
    async with Engine.open(vault, **_engine_options(args), max_batch=1) as engine:
        _say_memory(engine, not engine.speaks)
        if await _follow_rank0(engine):
            return 0
        print(
            f"loaded {vault} in {time.perf_counter() - start:.1f} s; computing in "
            f"{_dtype_note(engine)}; sampling at temperature {temperature:g}, top_p "
            f"{top_p:g}" + (f" ({origin})" if args.temp is None and args.top_p is None else ""),
            file=sys.stderr,
        )
        await _warm_up(engine, args, temperature=temperature, top_p=top_p, seed=args.seed)
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


def cmd_serve(args: argparse.Namespace) -> int:
    from smoe.util.loop import run

    return run(_serve(args))


async def _serve(args: argparse.Namespace) -> int:
    from smoe.engine import Engine
    from smoe.serve.app import ServerOptions, serve
    from smoe.serve.intake import MIN_REQUEST_MEMORY, serve_reserve
    from smoe.serve.listener import base_urls

    _log_to_stderr(args.log_level)
    api_key, guard = serve_guard(args)
    check_port_free(args.host, args.port)  # before minutes of loading, not after
    if not guard.loopback_only and not api_key:
        print(f"warning: serving on {args.host} without an API key", file=sys.stderr)
    if not args.idle_timeout > 0 or args.max_connections < 1:
        raise SmoeError("--idle-timeout must be above 0 and --max-connections at least 1")
    if (args.max_batch is not None and args.max_batch < 1) or args.max_queue < 0:
        raise SmoeError("--max-batch must be at least 1 and --max-queue at least 0")
    prefix_dir = args.prefix_cache_dir
    if prefix_dir is not None and await aiofiles.os.path.isfile(prefix_dir):
        raise SmoeError(f"--prefix-cache-dir {prefix_dir} is a file; name a directory")
    cached_bytes = _size_flag("--prefix-cache", args.prefix_cache)
    prefix_dir_bytes = _size_flag("--prefix-cache-disk", args.prefix_cache_disk)
    request_memory = _size_flag("--request-memory", args.request_memory)
    if request_memory < MIN_REQUEST_MEMORY:
        raise SmoeError(
            f"--request-memory must be at least {MIN_REQUEST_MEMORY // 2**20}MiB (a large "
            "body arriving and one request's preparation)"
        )
    _check_sampling_flags(args)  # before a download or the demo's first-run conversion
    vault = None if args.vault is None else resolve_model(args.vault, download=args.download)
    if vault is None:  # as `smoe chat`: the built-in demo
        from smoe.chat.demo import demo_vault

        vault = demo_vault(progress=lambda msg: print(msg, file=sys.stderr))
    from smoe.chat.sampling import suggested_sampling

    suggested = suggested_sampling(Path(vault))  # generation_config.json's, else greedy
    temperature = suggested["temperature"] if args.temp is None else args.temp
    top_p = suggested["top_p"] if args.top_p is None else args.top_p
    _check_sampling(temperature, top_p, args.max_tokens)  # before loading
    options = ServerOptions(
        api_key=api_key,
        guard=guard,
        idle_timeout_s=args.idle_timeout,
        max_connections=args.max_connections,
        max_queue=args.max_queue,
        model_name=Path(vault).name,
        temperature=temperature,
        top_p=top_p,
        max_tokens=args.max_tokens if args.max_tokens is not None else 256,
        prewarm_when_idle=args.prewarm,
        cached_bytes=cached_bytes,
        prefix_dir=None if prefix_dir is None else Path(prefix_dir),
        prefix_dir_bytes=prefix_dir_bytes,
        request_memory=request_memory,
    )
    reserve = serve_reserve(args.max_connections, request_memory)
    engine = Engine.open(
        vault, **_engine_options(args), max_batch=args.max_batch, host_reserve=reserve
    )
    async with engine:
        _say_memory(engine, not engine.speaks)
        if await _follow_rank0(engine):
            return 0
        await _warm_up(engine, args)

        def ready(port: int) -> None:
            base = f"http://{args.host}:{port}"
            print(
                f"serving {vault} on {base} ({base_urls(base)}); "
                f"computing in {_dtype_note(engine)}",
                file=sys.stderr,
            )

        await serve(engine, args.host, args.port, options, ready=ready)
    return 0


def _size_flag(flag: str, text: str) -> int:
    try:
        return parse_size(text)
    except SmoeError as e:
        raise SmoeError(f"{flag}: {e}") from None


def _check_sampling_flags(args: argparse.Namespace) -> None:
    """``_check_sampling`` of the flags given, each alone (the model's suggestions fill the
    others once it is found)."""
    temperature = 0.0 if args.temp is None else args.temp
    _check_sampling(temperature, 1.0 if args.top_p is None else args.top_p, args.max_tokens)


def _check_sampling(temperature: float, top_p: float, max_tokens: int | None) -> None:
    """SmoeError naming the flag for a sampling setting no reply could use."""
    from smoe.sampling import SamplingParams

    if max_tokens is not None and max_tokens < 1:
        raise SmoeError("--max-tokens must be at least 1")
    try:
        SamplingParams(temperature=temperature, top_p=top_p).check()
    except SmoeError as e:
        raise SmoeError(f"{e} (--temp, --top-p)") from None


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


def _say_memory(engine: Any, quiet: bool) -> None:
    """How --memory divided (smoe.plan.budget.Fit.line) and, where the disk was probed,
    how many I/O workers it got: a line each on stderr."""
    if quiet:
        return
    if engine.fit is not None:
        print(engine.fit.line(), file=sys.stderr)
    if engine.host_tier_line is not None:
        print(engine.host_tier_line, file=sys.stderr)
    if engine.workers_line is not None:
        print(engine.workers_line, file=sys.stderr)


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """Engine.open keyword arguments from the options _memory_option adds."""
    return {
        "memory": args.memory,
        "host_memory": args.host_memory,
        "slots": args.slots,
        "workers": args.workers,
        "dtype": args.dtype,
        "prefill_chunk": args.prefill_chunk,
        "max_context": args.max_context,
        "kv_bits": args.kv_bits,
        "device": args.device,
        "ring": args.ring,
        "policy": args.policy,
        "hint_depth": args.hint_depth,
        "spec": args.spec,
        "lookahead": args.lookahead,
        "distributed": args.distributed,
        "collective_timeout": args.collective_timeout,
        "draft": args.draft,
        "draft_tokens": args.draft_tokens,
        "cpu_kernels": args.cpu_kernels,
    }


def _distributed_options(p: Any) -> None:
    """--distributed and --collective-timeout (docs/distributed.md)."""
    p.add_argument(
        "--distributed",
        nargs="?",
        const="any",
        default=None,
        metavar="BACKEND",
        help="expert parallelism across the ranks mlx.launch started (docs/distributed.md): "
        "each rank reads and computes its own experts; rank 0 talks to the user. BACKEND: "
        "any (the launcher's), ring, mpi, nccl or jaccl (default: off, one process)",
    )
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="with --distributed: end with an error when a sum over ranks waits longer than "
        "this for a rank that hangs (default 120)",
    )


async def _follow_rank0(engine: Any) -> bool:
    """Chat and serve across ranks: rank 0 leads (it hears the users) and this returns
    False; another rank runs rank 0's requests until it ends, then this returns True."""
    if engine.ranks is None:
        return False
    if engine.ranks.rank == 0:
        await engine.lead()
        return False
    print(f"rank {engine.ranks.rank} of {engine.ranks.size}: following rank 0", file=sys.stderr)
    await engine.follow()
    return True


def _seed_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed for sampling: the same seed, prompt and options give the same reply "
        "(default: none, MLX's random state)",
    )


def _download_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--download",
        action="store_true",
        help="a Hub name (org/name) not in the local Hugging Face cache is downloaded "
        "first (without it, only a downloaded one is used)",
    )


def _verbose_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--verbose",
        action="store_true",
        help="accepted as ollama's and mlx-lm's: the timings and the memory's division are "
        "printed on stderr anyway (default)",
    )


def _warm_up_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="do not compile MLX's kernels with a throwaway generation at start (the first "
        "reply then pays for it: seconds on a fresh machine)",
    )


async def _warm_up(engine: Any, args: argparse.Namespace, **sampling: Any) -> None:
    """Engine.warm_up, shown as one line on stderr; not on ranks (rank 0 drives them)."""
    if not args.warm_up or engine.ranks is not None:
        return
    print("warming up the kernels ... ", end="", file=sys.stderr, flush=True)
    seconds = await engine.warm_up(**sampling)
    print(f"{seconds:.1f} s", file=sys.stderr)


ADVANCED = "advanced (ring and policy)"  # the title the tuning knobs' --help group has


def _memory_option(p: argparse.ArgumentParser) -> None:
    """The engine options generate, chat and serve share: the basics (--memory,
    --max-context, --dtype, --device) among the command's own, then the ring and policy
    knobs and the distributed ones in groups of their own, so --help shows the basics first."""
    p.add_argument(
        "--memory",
        default=None,
        help="the whole process's memory, e.g. 6GB: backbone + KV caches + working memory "
        "+ the expert ring, which gets the rest (`smoe plan` shows the split; default: every "
        "expert if they fit in half the available memory beside the backbone, else as many "
        "as fit)",
    )
    add_host_memory(p)
    p.add_argument(
        "-c",
        "--max-context",
        "--ctx-size",
        type=int,
        default=None,
        metavar="TOKENS",
        help="longest prompt + reply in tokens, which the KV caches are budgeted for "
        "(default 4096, or the model's maximum if smaller; with --memory, halved down to "
        "512 until it fits)",
    )
    add_dtype(p)
    add_device(p)
    p.add_argument(
        "--cpu-kernels",
        choices=("auto", "mlx"),
        default="auto",
        help="the CPU's matmuls: auto (S-MoE's vectorized, threaded kernels, bit for bit "
        "MLX's, where they run: Linux x86-64) or mlx (MLX's own, one core each); "
        "default auto",
    )
    advanced = p.add_argument_group(
        ADVANCED, "how the expert ring is sized, read, evicted and prefetched into"
    )
    _ring_options(advanced)
    _speculation_options(advanced)
    _distributed_options(p.add_argument_group("distributed (docs/distributed.md)"))


def _ring_options(g: Any) -> None:
    """The advanced group's ring knobs: its size, its reads, its policy, the KV cache."""
    g.add_argument(
        "--slots",
        type=int,
        default=None,
        help="ring size in experts (wins over --memory; default: what --memory leaves)",
    )
    add_workers(g)
    g.add_argument(
        "--prefill-chunk", type=int, default=64, help="prompt tokens per chunk (default 64)"
    )
    g.add_argument(
        "--kv-bits",
        type=int,
        choices=KV_BITS,
        default=None,
        help="quantize the KV cache to 4 or 8 bits (mlx-lm's; 0.28x or 0.16x of a float32 "
        "cache, 0.56x or 0.31x of bf16's; budgeted in --memory): output matches mlx-lm "
        "with the same setting (default: off, the model's dtype)",
    )
    g.add_argument(
        "--ring",
        choices=("auto", "unified", "staged"),
        default="auto",
        help="where reads land: unified (in the slots: CPU, Apple) or staged (host landing "
        "buffers copied into device arrays in the compute dtype: CUDA GPUs, and vaults whose "
        "scales are not in the compute dtype); default auto: it picks (docs/gpu.md)",
    )
    g.add_argument(
        "--policy",
        default="lfu",
        help="ring eviction policy: lfu (default), lru, slru, arc, lru-layer; lfu+hint, "
        "lru+hint and lru-layer+hint also feed it the router's near misses "
        "(docs/cache-policy.md)",
    )
    g.add_argument(
        "--hint-depth",
        type=int,
        default=None,
        help="with a +hint policy: hint gate ranks top_k..N-1 (default 4 x top_k)",
    )


def _speculation_options(g: Any) -> None:
    """The advanced group's prefetch and draft knobs (docs/speculation.md, docs/draft.md)."""
    g.add_argument(
        "--no-lookahead",
        dest="lookahead",
        action="store_false",
        help="do not prefetch the next layer's experts predicted by its router on this "
        "layer's input (on by default: docs/speculation.md)",
    )
    g.add_argument(
        "--spec",
        type=int,
        default=0,
        help="gate-echo bets: prefetch gate ranks k..k+N-1 for the next token "
        "(default 0: measured net negative so far, docs/speculation.md)",
    )
    g.add_argument(
        "--draft",
        choices=("ngram",),
        default=None,
        help="draft tokens by prompt lookup and verify them in one pass (lossless: greedy "
        "output unchanged; off by default, and off for a request while it does not pay: "
        "docs/draft.md)",
    )
    g.add_argument(
        "--draft-tokens",
        type=int,
        default=4,
        metavar="K",
        help="with --draft: tokens drafted per verify pass (default 4)",
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
    _seed_option(g)
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
    _verbose_option(g)
    _download_option(g)
    _memory_option(g)
    g.set_defaults(func=cmd_generate, settle=settle_generate)


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
    _seed_option(ch)
    _warm_up_option(ch)
    _verbose_option(ch)
    _download_option(ch)
    _memory_option(ch)
    ch.set_defaults(func=cmd_chat, settle=settle_chat)


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
    _warm_up_option(sv)
    _download_option(sv)
    _memory_option(sv)
    sv.set_defaults(func=cmd_serve, settle=settle_chat)  # (MODEL optional, as in chat)
