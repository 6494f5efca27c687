"""The learning cache: a per-vault popularity histogram of routed experts, kept across runs.

Counts live in VAULT/stats/popularity.npz (never shared between vaults), merged and
rewritten atomically when an engine closes. They drive idle pre-warm (read the hottest
experts into EMPTY ring slots while nobody is waiting) and the optional pinned hot set
(`policy="hot"`).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np

from smoe.vault.format import Vault

FILE = "popularity.npz"


class Popularity:
    """Demand counts per (MoE layer position, expert): float64 [L, E]."""

    def __init__(self, vault: Vault) -> None:
        m = vault.manifest
        self.path = vault.stats_dir / FILE
        self.layers = [s.layer for s in m.layers]
        self._pos = {layer: i for i, layer in enumerate(self.layers)}
        self.counts = np.zeros((len(self.layers), m.num_experts), np.float64)
        self.session = np.zeros_like(self.counts)  # this run's counts, merged on save
        self._load()

    def _load(self) -> None:
        try:
            with np.load(self.path) as z:
                if z["counts"].shape == self.counts.shape:
                    self.counts = z["counts"].astype(np.float64)
        except (OSError, KeyError, ValueError):
            pass  # no history yet, or an unreadable one: start afresh

    def add(self, layer: int, experts: np.ndarray) -> None:
        """Count one routing decision's experts (any shape of expert ids)."""
        np.add.at(self.session[self._pos[layer]], experts.reshape(-1), 1.0)

    def add_counts(self, layers: list[int], counts: np.ndarray) -> None:
        """Add per-expert counts [len(layers), E] of the given MoE layers."""
        np.add.at(self.session, [self._pos[layer] for layer in layers], counts)

    def hottest(self, n: int) -> list[tuple[int, int]]:
        """The ``n`` most requested (layer, expert) keys, history and this run together."""
        total = (self.counts + self.session).reshape(-1)
        order = np.argsort(-total, kind="stable")[:n]
        e = self.counts.shape[1]
        return [(self.layers[i // e], int(i % e)) for i in order if total[i] > 0]

    def as_mapping(self) -> dict[tuple[int, int], int]:
        total = self.counts + self.session
        e = total.shape[1]
        return {
            (self.layers[i // e], i % e): int(c) for i, c in enumerate(total.reshape(-1)) if c > 0
        }

    def save(self) -> Path | None:
        """Merge this run into the file (temp name, fsync, rename). A read-only vault is
        fine: the history is then not kept, with a warning."""
        if not self.session.any():
            return None
        merged = self.counts + self.session
        tmp = self.path.with_name(f".{self.path.stem}.tmp-{os.getpid()}.npz")
        try:
            self.path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                np.savez(f, counts=merged)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            warnings.warn(f"cannot keep expert popularity in {self.path} ({e})", stacklevel=2)
            return None
        self.counts, self.session = merged, np.zeros_like(merged)
        return self.path
