"""The learning cache: a per-vault popularity histogram of routed experts, kept across runs.

Counts live in VAULT/stats/popularity.npz (never shared between vaults), merged and
rewritten atomically when an engine closes. They drive idle pre-warm (read the hottest
experts into EMPTY ring slots while nobody is waiting) and the optional pinned hot set
(`policy="hot"`).

Several processes may use one vault: each save re-reads the file under an flock on
stats/popularity.lock and adds only its own session, so no process's counts are lost. A
file that cannot be this vault's counts is set aside as popularity.npz.corrupt, with a
warning, and the history starts afresh: it is a cache, never a reason to refuse a vault.
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings
from pathlib import Path

import numpy as np

from smoe.util.files import atomic_write, file_lock, kill_point, sweep_stale
from smoe.vault.format import Vault
from smoe.vault.names import MANIFEST

FILE = "popularity.npz"
CORRUPT = FILE + ".corrupt"
LOCK = "popularity.lock"


class Popularity:
    """Demand counts per (MoE layer position, expert): float64 [L, E]."""

    def __init__(self, vault: Vault) -> None:
        m = vault.manifest
        self.path = vault.stats_dir / FILE
        self.lock_path = vault.stats_dir / LOCK
        self.layers = [s.layer for s in m.layers]
        self._pos = {layer: i for i, layer in enumerate(self.layers)}
        self.shape = (len(self.layers), m.num_experts)
        self.session = np.zeros(self.shape, np.float64)  # this run's counts, merged on save
        # The vault these counts are of: a conversion with --force may replace the folder
        # while we run (save then keeps nothing rather than write into the new model's).
        self.manifest_path = vault.path / MANIFEST
        self._manifest_digest = _digest(self.manifest_path)
        sweep_stale(vault.stats_dir)  # temporaries of saves that were killed
        self.counts = self._load()

    def _load(self) -> np.ndarray:
        with contextlib.ExitStack() as stack:
            try:  # opening a vault never waits: a save holding the lock may be stopped
                stack.enter_context(file_lock(self.lock_path, wait=False))
                locked = True
            except OSError:  # read-only vault, or lock busy: just read (writes are atomic)
                locked = False  # and leave a bad file where it is
            return self._read(set_aside=locked)

    def _read(self, set_aside: bool) -> np.ndarray:
        """The counts kept in the file (zeros if there is none). A file that cannot be this
        vault's counts (unreadable, truncated, not an npz, wrong shape, NaN or negative)
        gives a one-line warning and zeros; with ``set_aside`` (the lock held) it is renamed
        popularity.npz.corrupt, so it warns once and the next save starts a good file."""
        try:  # our own handle: np.load leaks its file when the zip is bad
            with open(self.path, "rb") as f, np.load(f, allow_pickle=False) as z:
                counts = np.asarray(z["counts"])
        except FileNotFoundError:
            return np.zeros(self.shape, np.float64)
        except Exception as e:  # BadZipFile, EOFError, zlib.error, KeyError, ValueError...
            problem = f"unreadable ({type(e).__name__}: {e})"
        else:
            if counts.shape != self.shape:
                problem = f"shaped {counts.shape}, this vault has {self.shape}"
            elif counts.dtype.kind not in "fiu" or not np.isfinite(counts).all():
                problem = "not finite numbers"
            elif (counts < 0).any():
                problem = "negative counts"
            else:
                return counts.astype(np.float64)
        where = ""
        if set_aside:
            try:
                self.path.replace(self.path.with_name(CORRUPT))
                where = f"; moved to {CORRUPT}"
            except OSError:
                pass
        warnings.warn(
            f"ignoring expert popularity {self.path}: {problem}{where}; counting afresh",
            stacklevel=3,
        )
        return np.zeros(self.shape, np.float64)

    def add(self, layer: int, experts: np.ndarray) -> None:
        """Count one routing decision's experts (any shape of expert ids)."""
        np.add.at(self.session[self._pos[layer]], experts.reshape(-1), 1.0)

    def add_counts(self, layers: list[int], counts: np.ndarray) -> None:
        """Add per-expert counts [len(layers), E] of the given MoE layers."""
        rows = [self._pos[layer] for layer in layers]
        if len(set(rows)) == len(rows):  # a pass names each layer once: a plain add
            self.session[rows] += counts  # (np.add.at costs ~240 us a token at 16 x 128)
        else:
            np.add.at(self.session, rows, counts)

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
        """Add this run's counts to the file: under the lock, re-read it (other processes may
        have saved since we loaded), add the session, write it atomically. A read-only vault
        or another OSError only warns: the history is then not kept. Returns the file, or
        None if nothing was written."""
        if not self.session.any():
            return None
        if _digest(self.manifest_path) != self._manifest_digest:
            warnings.warn(
                f"{self.manifest_path.parent} was replaced by another vault while this run "
                "used it (a conversion with --force): this run's expert popularity is not "
                "kept there",
                stacklevel=2,
            )
            return None
        try:
            self.path.parent.mkdir(exist_ok=True)
            with file_lock(self.lock_path):
                kill_point("popularity.locked")
                merged = self._read(set_aside=True) + self.session
                with atomic_write(self.path, keep_suffix=True) as f:
                    np.savez(f, counts=merged)
        except OSError as e:
            warnings.warn(
                f"cannot keep expert popularity in {self.path} ({e}): make "
                f"{self.path.parent} a writable folder to keep it",
                stacklevel=2,
            )
            return None
        self.counts, self.session = merged, np.zeros_like(merged)
        return self.path


def _digest(path: Path) -> str | None:
    """sha256 of a (small) file, or None if it cannot be read."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None
