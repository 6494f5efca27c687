"""Which rank computes each routed expert: the expert-parallel assignment.

Every routed expert (MoE layer, expert) has exactly one owner rank. Each rank reads and
computes only its own experts; the others contribute exact zeros for them, so the sum
over ranks is the single machine's value bit for bit (docs/distributed.md).

The assignment balances, per MoE layer, the expected work of each rank, because every
layer waits for its slowest rank: with a popularity histogram (the vault's learning cache)
experts go, most popular first, to the rank with the least expected load so far (greedy
longest-processing-time); without one, expert e of a layer goes to rank e mod N. Ties are
broken by expert id and rank, so the same inputs give the same assignment everywhere.
No MLX import.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from smoe.errors import SmoeError


@dataclass(frozen=True)
class ExpertAssignment:
    """``owners[i, e]``: the rank that computes expert ``e`` of MoE layer ``layers[i]``."""

    layers: tuple[int, ...]  # model layer ids of the MoE layers, in manifest order
    owners: np.ndarray  # [L, E] int32 ranks
    ranks: int

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise SmoeError("an expert assignment needs at least one rank")
        if self.owners.shape[0] != len(self.layers) or self.owners.ndim != 2:
            raise SmoeError(
                f"an expert assignment of shape {self.owners.shape} does not fit "
                f"{len(self.layers)} MoE layers"
            )
        if self.owners.size and (self.owners.min() < 0 or self.owners.max() >= self.ranks):
            raise SmoeError(f"an expert assignment names a rank outside 0..{self.ranks - 1}")

    @classmethod
    def balanced(
        cls,
        layers: list[int],
        experts: int,
        ranks: int,
        popularity: np.ndarray | None = None,
    ) -> ExpertAssignment:
        """The assignment for ``ranks`` ranks; ``popularity`` [L, E] (times each expert
        was routed to), where there is one, balances each layer's expected work."""
        if ranks < 1:
            raise SmoeError("an expert assignment needs at least one rank")
        owners = np.zeros((len(layers), experts), dtype=np.int32)
        for i in range(len(layers)):
            if popularity is None or not popularity[i].any():
                owners[i] = np.arange(experts) % ranks
                continue
            load = np.zeros(ranks, dtype=np.float64)
            count = np.zeros(ranks, dtype=np.int64)
            # most popular first; ties by expert id (a stable sort of -counts)
            for e in np.argsort(-popularity[i], kind="stable"):
                # least expected load, then fewest experts, then lowest rank
                r = int(np.lexsort((np.arange(ranks), count, load))[0])
                owners[i, e] = r
                load[r] += float(popularity[i, e])
                count[r] += 1
        return cls(tuple(layers), owners, ranks)

    def owns(self, rank: int, layer: int, expert: int) -> bool:
        return bool(self.owners[self.layers.index(layer), expert] == rank)

    def owned(self, rank: int, layer: int) -> np.ndarray:
        """[E] bool: the experts of ``layer`` that ``rank`` computes."""
        return np.asarray(self.owners[self.layers.index(layer)] == rank)

    def owned_keys(self, rank: int) -> list[tuple[int, int]]:
        """Every (layer, expert) that ``rank`` computes, in record order."""
        return [
            (layer, int(e))
            for i, layer in enumerate(self.layers)
            for e in np.flatnonzero(self.owners[i] == rank)
        ]

    def share(self, rank: int) -> float:
        """The fraction of all routed experts that ``rank`` owns."""
        return float((self.owners == rank).mean()) if self.owners.size else 0.0

    def fingerprint(self) -> int:
        """A 31-bit checksum of the whole assignment, for ranks to compare."""
        data = np.ascontiguousarray(self.owners, dtype="<i4").tobytes()
        head = np.array([self.ranks, *self.layers], dtype="<i8").tobytes()
        return zlib.crc32(head + data) & 0x7FFFFFFF
