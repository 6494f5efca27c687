"""The built-in demo model: synthesised and converted into a cache directory on first use.

A small Qwen3-MoE (the `demo` synth preset: 6 layers, 16 experts, top-4) with random but
decisive weights and a real tokenizer and chat template. It says nothing sensible; it lets
a newcomer try the whole pipeline (vault, ring, streaming, chat) in seconds without a
download. Later starts reuse the vault.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from smoe.errors import SmoeError, VaultError
from smoe.vault.format import Vault

DEMO_NAME = "demo-qwen3-moe-v1"


def cache_dir() -> Path:
    """$SMOE_CACHE, else $XDG_CACHE_HOME/smoe, else ~/.cache/smoe."""
    if os.environ.get("SMOE_CACHE"):
        return Path(os.environ["SMOE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "smoe"


def demo_vault(progress: Callable[[str], None] | None = None) -> Path:
    """The demo vault's path, building it first if it is missing or damaged."""
    target = cache_dir() / DEMO_NAME
    try:
        # One made before vaults checksummed their backbone is rebuilt, not warned about.
        if "checksum" in Vault.open(target).manifest.backbone:
            return target
    except VaultError:
        pass
    from smoe.synth import synthesize
    from smoe.vault.convert import ConvertOptions, convert

    say = progress or (lambda _: None)
    if target.exists():  # ours: damaged, or made by an older S-MoE
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    source = target.parent / f".{DEMO_NAME}.source-{os.getpid()}"
    try:
        say("making the demo model (first run only)...")
        synthesize(source, arch="qwen3_moe", preset="demo", seed=0, force=True)
        say("converting it into a vault...")
        convert(source, target, ConvertOptions(dtype="float32", force=True))
    except OSError as e:
        raise SmoeError(
            f"cannot build the demo model in {target.parent} ({e}); "
            "set SMOE_CACHE to a writable folder"
        ) from None
    finally:
        shutil.rmtree(source, ignore_errors=True)
    say(f"demo vault ready: {target}")
    return target
