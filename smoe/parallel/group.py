"""This process's place in an ``mx.distributed`` group, and the few collectives S-MoE uses.

Every call here is an MLX operation: run it on the engine's compute thread, like every
other MLX call. The ranks must call the collectives in the same order; the engine keeps
that order by running the same forward passes on every rank.

- ``join``: the group ``mlx.launch`` (or MPI) started this process in; one rank alone
  when started without it and ``backend`` is "any".
- ``gather``: every rank's integers (what each opened, its I/O), on every rank.
- ``from_rank0``: rank 0's array on every rank (a sum to which the others add zeros).
- ``all_sum``: the expert outputs, each entry computed on exactly one rank, the others
  adding exact zeros, so the sum is that rank's value, bit for bit.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from smoe.errors import GroupError, SmoeError
from smoe.parallel import BACKENDS


class RankGroup:
    """One rank's view of the group: ``rank``, ``size`` and the collectives."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = int(group.rank())
        self.size = int(group.size())

    @classmethod
    def join(cls, backend: str = "any") -> RankGroup:
        """The group this process was launched in. SmoeError if ``backend`` is unknown or
        cannot start (the message names the launcher)."""
        if backend not in BACKENDS:
            raise SmoeError(f"unknown distributed backend {backend!r}; use one of {BACKENDS}")
        if not mx.distributed.is_available():
            raise SmoeError("this MLX build has no distributed backend; reinstall mlx")
        try:
            group = mx.distributed.init(strict=backend != "any", backend=backend)
        except (RuntimeError, ValueError) as e:
            raise SmoeError(
                f"cannot join a distributed group over {backend} ({e}); start every rank "
                "with mlx.launch, e.g. 'mlx.launch -n 2 --backend ring -- smoe generate ...'"
            ) from None
        return cls(group)

    def gather(self, values: list[int]) -> np.ndarray:
        """[size, n] int64: every rank's ``values``, in rank order, on every rank."""
        mine = mx.array(np.asarray(values, dtype=np.int64))
        return np.array(mx.distributed.all_gather(mine[None], group=self.group))

    def from_rank0(self, array: np.ndarray) -> np.ndarray:
        """Rank 0's ``array`` (int64 values) on every rank; the others pass any array of
        the same shape."""
        mine = np.asarray(array, dtype=np.int64)
        part = mx.array(mine if self.rank == 0 else np.zeros_like(mine))
        return np.array(mx.distributed.all_sum(part, group=self.group))

    def all_sum(self, y: mx.array) -> mx.array:
        """The sum over ranks of ``y`` (same shape and dtype on every rank)."""
        if self.size == 1:
            return y
        return mx.distributed.all_sum(y, group=self.group)


def lost(e: RuntimeError) -> GroupError:
    """The error a rank reports when a collective failed under it (a peer died or its
    connection broke: MLX's backends raise RuntimeError)."""
    return GroupError(
        f"the expert-parallel group broke ({' '.join(str(e).split())}): a rank died or lost "
        "its connection; check the other ranks' output, then restart every rank"
    )
