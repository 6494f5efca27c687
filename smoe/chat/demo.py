"""The built-in demo model: a small trained Qwen3-MoE, converted into a vault on first use.

The checkpoint ships in the package (demo_model/, 25 MB in bfloat16): 6 layers of 32
experts (top-4), hidden 256, a 4096-token BPE, trained on the King James Bible by
train/demo/ (docs/demo-model.md says how, and what it scores). It answers in fluent
King James English, and its routing was learned, so the demo streams real expert traffic.
The vault takes a few seconds to convert on the first start; later starts reuse it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from smoe.errors import SmoeError, VaultError
from smoe.util.cache import cache_dir
from smoe.vault.format import Vault

DEMO_NAME = "demo-kjv-qwen3-moe-v2"
DEMO_SOURCE = Path(__file__).parent / "demo_model"
# Vaults of earlier demos, removed when the current one is built (they are ours, in our cache).
OLD_DEMOS = ("demo-qwen3-moe-v1",)


def demo_vault(progress: Callable[[str], None] | None = None) -> Path:
    """The demo vault's path, building it first if it is missing or damaged."""
    target = cache_dir() / DEMO_NAME
    try:
        # One made before vaults checksummed their backbone is rebuilt, not warned about.
        if "checksum" in Vault.open(target).manifest.backbone:
            return target
    except VaultError:
        pass
    from smoe.vault.convert import ConvertOptions, convert

    say = progress or (lambda _: None)
    if target.exists():  # ours: damaged, or made by an older S-MoE
        shutil.rmtree(target)
    for old in OLD_DEMOS:
        shutil.rmtree(target.parent / old, ignore_errors=True)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        say("converting the demo model into a vault (first run only)...")
        # 4-bit experts as any vault has by default: held-out perplexity 26.26 against
        # 26.15 unquantized (docs/demo-model.md); float32 is the CPU's fast dtype.
        convert(DEMO_SOURCE, target, ConvertOptions(dtype="float32", force=True))
    except OSError as e:
        raise SmoeError(
            f"cannot build the demo model in {target.parent} ({e}); "
            "set SMOE_CACHE to a writable folder"
        ) from None
    say(f"demo vault ready: {target}")
    return target
