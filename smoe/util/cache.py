"""Where S-MoE keeps what it can make again: converted demo vaults, a download's stats, the
disk probe's figures."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$SMOE_CACHE, else $XDG_CACHE_HOME/smoe, else ~/.cache/smoe."""
    if os.environ.get("SMOE_CACHE"):
        return Path(os.environ["SMOE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "smoe"
