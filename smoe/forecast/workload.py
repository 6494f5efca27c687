"""What the probes and benchmarks run: a random prompt of a vault's vocabulary, and a ring
filled with every expert before a resident run is timed."""

from __future__ import annotations

import random

from smoe.engine import Engine
from smoe.vault.format import Vault


def random_prompt(vault: Vault, tokens: int, seed: int = 0) -> list[int]:
    """``tokens`` random ids of the vault's vocabulary (above the first 10: no specials)."""
    rng = random.Random(seed)
    vocab = vault.manifest.shape.vocab_size
    return [rng.randrange(10, vocab) for _ in range(tokens)]


async def fill_ring(engine: Engine) -> None:
    """Read every expert into the engine's ring (which must hold them all), untimed."""
    await engine.learning.load_all()
