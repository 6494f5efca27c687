"""The flags `smoe generate`, `chat` and `serve` share: the engine's options (--memory,
--slots, --policy ...: smoe.plan.options.EngineOptions.from_args reads them) and the few
each of them takes alike (--seed, --download, --verbose, --no-warm-up). Declared once."""

from __future__ import annotations

import argparse
from typing import Any

from smoe.commands.options import add_device, add_dtype, add_host_memory, add_workers, size_arg
from smoe.plan.budget import KV_BITS

ADVANCED = "advanced (ring and policy)"  # the title the tuning knobs' --help group has


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The engine options generate, chat and serve share: the basics (--memory,
    --max-context, --dtype, --device) among the command's own, then the ring and policy
    knobs and the distributed ones in groups of their own, so --help shows the basics first."""
    p.add_argument(
        "--memory",
        type=size_arg,
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
    _ring_flags(advanced)
    _speculation_flags(advanced)
    _distributed_flags(p.add_argument_group("distributed (docs/distributed.md)"))


def _ring_flags(g: Any) -> None:
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


def _speculation_flags(g: Any) -> None:
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


def _distributed_flags(p: Any) -> None:
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


def add_seed_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed for sampling: the same seed, prompt and options give the same reply "
        "(default: none, MLX's random state)",
    )


def add_download_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--download",
        action="store_true",
        help="a Hub name (org/name) not in the local Hugging Face cache is downloaded "
        "first (without it, only a downloaded one is used)",
    )


def add_verbose_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--verbose",
        action="store_true",
        help="accepted as ollama's and mlx-lm's: the timings and the memory's division are "
        "printed on stderr anyway (default)",
    )


def add_warm_up_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="do not compile MLX's kernels with a throwaway generation at start (the first "
        "reply then pays for it: seconds on a fresh machine)",
    )
