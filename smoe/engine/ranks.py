"""An engine's place among expert-parallel ranks (``EngineOptions.distributed``).

``Ranks.join`` joins the group, checks that every rank opened the same vault, and takes
rank 0's expert assignment (balanced by rank 0's popularity counts), so every rank computes
the same ownership. The engine then gives its expert layers this rank's shards
(``shards``), keeps its prewarm to its own experts (``owns``), sizes its ring for them
(``ring_slots``), and runs the few collectives a user needs (``from_rank0``, ``gather``).

Every collective runs on the engine's compute thread, as every MLX call does, and the
ranks must call them in the same order: they do when they run the same requests. A
collective that fails (a peer died) is a GroupError.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from smoe.compute.sharded import ExpertShard, ShardedSlots
from smoe.parallel.assignment import ExpertAssignment
from smoe.parallel.group import RankGroup, lost
from smoe.parallel.watchdog import Watchdog
from smoe.vault.format import Vault
from smoe.vault.names import MANIFEST


class Ranks:
    """This rank's group and the expert assignment every rank shares."""

    def __init__(
        self,
        group: RankGroup,
        assignment: ExpertAssignment,
        compute: Any,
        watchdog: Watchdog,
    ) -> None:
        self.group = group
        self.assignment = assignment
        self.watchdog = watchdog  # ends a collective that waits forever on a hung rank
        self._compute = compute  # the engine's ComputeThread

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.size

    @classmethod
    async def join(
        cls, compute: Any, vault: Vault, backend: str, popularity: np.ndarray, watchdog: Watchdog
    ) -> Ranks:
        """Join over ``backend``; GroupError if a rank opened another vault or the group
        broke, SmoeError if no group can start (the message names mlx.launch).
        ``watchdog`` times every collective from here on."""
        m = vault.manifest
        group = await compute.run(RankGroup.join, backend)
        watched = _Watched(compute, watchdog)
        manifest = (vault.path / MANIFEST).read_bytes()  # small: checked when opened
        await _collective(
            watched,
            group.agree,
            [zlib.crc32(manifest) & 0x7FFFFFFF, m.num_records],
            "vault",
            "give every rank a copy of the same vault",
        )
        layers = [spec.layer for spec in m.layers]
        mine = ExpertAssignment.balanced(layers, m.num_experts, group.size, popularity)
        owners = await _collective(watched, group.from_rank0, mine.owners)
        assignment = ExpertAssignment(tuple(layers), owners.astype(np.int32), group.size)
        return cls(group, assignment, compute, watchdog)

    def ring_slots(self, planned: int) -> int:
        """A ring for this rank's experts at most: slots beyond them would stay empty."""
        return max(1, min(planned, len(self.assignment.owned_keys(self.rank))))

    def owns(self, layer: int, expert: int) -> bool:
        return self.assignment.owns(self.rank, layer, expert)

    def shards(self, source: Any) -> tuple[ShardedSlots, dict[int, ExpertShard]]:
        """``source`` kept to this rank's experts, and per MoE layer its shard (compute
        thread: the shards' sums are MLX operations)."""
        owned = {layer: self.assignment.owned(self.rank, layer) for layer in self.assignment.layers}
        shards = {layer: ExpertShard(mask, self._reduce, lost) for layer, mask in owned.items()}
        return ShardedSlots(source, owned), shards

    def _reduce(self, y: Any) -> Any:
        """Compute thread: a layer's sum over ranks, evaluated, under the watchdog."""
        import mlx.core as mx

        with self.watchdog.watch("the sum of a MoE layer's expert outputs"):
            y = self.group.all_sum(y)
            mx.eval(y)
        return y

    def owned_counts(self) -> list[int]:
        """Experts each rank owns, in rank order."""
        return [len(self.assignment.owned_keys(r)) for r in range(self.size)]

    async def from_rank0(self, value: int) -> int:
        """Rank 0's ``value`` on every rank."""
        got = await _collective(
            _Watched(self._compute, self.watchdog), self.group.from_rank0, np.array([value])
        )
        return int(got[0])

    async def gather(self, values: list[int]) -> np.ndarray:
        """[size, n]: every rank's ``values``, in rank order."""
        watched = _Watched(self._compute, self.watchdog)
        return np.asarray(await _collective(watched, self.group.gather, values))


def io_by_rank(rows: np.ndarray, owned: list[int]) -> list[dict[str, Any]]:
    """Rows of [hits, misses, bytes read, microseconds waiting] per rank, as reported."""
    out = []
    for rank, (hits, misses, read, wait_us) in enumerate(rows.tolist()):
        out.append(
            {
                "rank": rank,
                "experts_owned": owned[rank],
                "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
                "bytes_read": read,
                "io_wait_s": wait_us / 1e6,
            }
        )
    return out


class _Watched:
    """A compute thread whose jobs (collectives) run under the watchdog."""

    def __init__(self, compute: Any, watchdog: Watchdog) -> None:
        self._compute, self._watchdog = compute, watchdog

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        def watched() -> Any:
            with self._watchdog.watch(f"a collective ({getattr(fn, '__name__', 'step')})"):
                return fn(*args)

        return await self._compute.run(watched)


async def _collective(compute: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` (a collective) on the compute thread; GroupError if it failed."""
    try:
        return await compute.run(fn, *args)
    except RuntimeError as e:
        raise lost(e) from None
