"""Vault shards: rank r of N keeps only the expert records it computes (docs/distributed.md).

A shard is a vault whose manifest has a "shard" entry: {"rank", "ranks", "owners", "base"}.
``owners[i][e]`` is the rank that computes expert e of MoE layer i (manifest order), the
whole group's assignment, so every rank can check that its shard belongs to the same cut;
``base`` is the identity of the full vault it was cut from. experts.bin holds the records
of the experts ``owners`` gives to ``rank``, layer-major, with their checksums, byte for
byte those of the full vault. The backbone and every other file are the full vault's.

``write_shard`` cuts one; ``Shard.from_json`` validates the entry of an untrusted manifest.
No MLX import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from smoe.vault.checks import Check

MAX_RANKS = 4096


@dataclass(frozen=True)
class Shard:
    """Which ranks own which experts, and which of them this vault holds."""

    rank: int
    ranks: int
    owners: tuple[tuple[int, ...], ...]  # [L][E] ranks, MoE layers in manifest order
    base: int  # identity of the full vault (Manifest.identity)
    layers: tuple[int, ...]  # model layer ids of the MoE layers
    keys: tuple[tuple[int, int], ...] = field(init=False)  # (layer, expert) of each record
    index: dict[tuple[int, int], int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        keys = tuple(
            (layer, e)
            for layer, row in zip(self.layers, self.owners, strict=True)
            for e, owner in enumerate(row)
            if owner == self.rank
        )
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "index", {k: i for i, k in enumerate(keys)})

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "ranks": self.ranks,
            "owners": [list(row) for row in self.owners],
            "base": self.base,
        }

    @classmethod
    def from_json(cls, c: Check, value: Any, layers: tuple[int, ...], num_experts: int) -> Shard:
        """The manifest's "shard" entry, validated against its MoE layers and experts."""
        d = c.obj(value, "shard")
        ranks = c.int_(c.key(d, "ranks", "shard"), "shard.ranks", 1, MAX_RANKS)
        rank = c.int_(c.key(d, "rank", "shard"), "shard.rank", 0, ranks - 1)
        base = c.int_(c.key(d, "base", "shard"), "shard.base")
        rows = c.list_(c.key(d, "owners", "shard"), "shard.owners", len(layers), len(layers))
        owners = []
        for i, row in enumerate(rows):
            at = f"shard.owners[{i}]"
            row = c.list_(row, at, num_experts, num_experts)
            owners.append(tuple(c.int_(r, f"{at}[{e}]", 0, ranks - 1) for e, r in enumerate(row)))
        return cls(rank, ranks, tuple(owners), base, layers)
