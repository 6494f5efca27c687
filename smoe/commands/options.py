"""Options several commands take with the same meaning: declared once."""

from __future__ import annotations

import argparse
from typing import Any

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
        default=None,
        metavar="SIZE",
        help="host RAM for copies of experts between a GPU's ring and the disk, e.g. 64GB "
        "(a miss it holds is copied over the bus instead of read; on top of --memory, which "
        "is the GPU's there; 0: none; default: half the available memory where the ring is "
        "in a discrete GPU's memory, else none; docs/cache-policy.md)",
    )
