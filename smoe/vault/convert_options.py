"""What `smoe convert` is asked for (``ConvertOptions``), the values each option takes, and
the check of the options against the source (``check_options``). Both the conversion
(smoe.vault.convert) and its plan (smoe.vault.plan) read them: neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smoe.errors import SmoeError

BITS_CHOICES = (2, 3, 4, 6, 8, 16)
GROUP_CHOICES = (32, 64, 128)
DTYPE_CHOICES = ("bfloat16", "float16", "float32")
DEFAULT_BITS = 4
DEFAULT_GROUP = 64


@dataclass(frozen=True)
class ConvertOptions:
    """What `smoe convert` was asked for. None means: what the source implies."""

    bits: int | None = None  # experts: 16 keeps float weights; None: 4 (or the source's)
    group_size: int | None = None  # None: 64 (or the source's)
    dtype: str | None = None  # float tensors' dtype; None: the source's
    backbone_bits: int | None = None  # None: backbone stays as in the source
    backbone_group_size: int = DEFAULT_GROUP
    force: bool = False


def check_options(opts: ConvertOptions, source_q: dict[str, Any] | None) -> tuple[int, int]:
    """The experts' (bits, group_size), or a SmoeError naming the bad option."""
    if opts.bits is not None and opts.bits not in BITS_CHOICES:
        raise SmoeError(f"--bits {opts.bits} is not supported; choose one of {BITS_CHOICES}")
    if opts.group_size is not None and opts.group_size not in GROUP_CHOICES:
        raise SmoeError(
            f"--group-size {opts.group_size} is not supported; choose one of {GROUP_CHOICES}"
        )
    if opts.dtype is not None and opts.dtype not in DTYPE_CHOICES:
        raise SmoeError(f"--dtype {opts.dtype} is not supported; choose one of {DTYPE_CHOICES}")
    if opts.backbone_bits is not None and opts.backbone_bits not in BITS_CHOICES[:-1]:
        raise SmoeError(f"--backbone-bits must be one of {BITS_CHOICES[:-1]}")
    if opts.backbone_group_size not in GROUP_CHOICES:
        raise SmoeError(f"--backbone-group-size must be one of {GROUP_CHOICES}")
    if source_q is None:
        return opts.bits or DEFAULT_BITS, opts.group_size or DEFAULT_GROUP
    sb, sg = source_q.get("bits"), source_q.get("group_size")
    if not isinstance(sb, int) or not isinstance(sg, int):
        raise SmoeError(
            "the source's config.json 'quantization' lacks integer bits and group_size: "
            "re-save it with mlx-lm's convert"
        )
    if (opts.bits not in (None, sb)) or (opts.group_size not in (None, sg)):
        raise SmoeError(
            f"the source is already MLX-quantized ({sb} bits, group {sg}) and is copied byte "
            "for byte, never re-quantized: drop --bits/--group-size"
        )
    if opts.backbone_bits is not None:
        raise SmoeError("the source is already MLX-quantized: drop --backbone-bits")
    return int(sb), int(sg)
