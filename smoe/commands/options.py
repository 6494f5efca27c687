"""Options several commands take with the same meaning: declared once."""

from __future__ import annotations

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
