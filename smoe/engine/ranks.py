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

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from smoe.compute.sharded import ExpertShard, ShardedSlots
from smoe.errors import GroupError
from smoe.parallel.assignment import ExpertAssignment
from smoe.parallel.group import RankGroup, lost
from smoe.parallel.watchdog import Watchdog
from smoe.vault.format import Vault


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
        self.sums = 0  # layer sums over ranks run, the seconds they took (waits included),
        self.sum_seconds = 0.0  # and the bytes each rank put in them
        self.sum_bytes = 0

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
        """Join over ``backend``; GroupError if the ranks opened different vaults or
        shards of different cuts, a shard of another rank, or the group broke; SmoeError if
        no group can start (the message names mlx.launch). ``watchdog`` times every
        collective from here on."""
        m = vault.manifest
        group = await compute.run(RankGroup.join, backend)
        watched = _Watched(compute, watchdog)
        layers = tuple(spec.layer for spec in m.layers)
        shard = m.shard
        mine = None
        if shard is not None:
            mine = ExpertAssignment(layers, np.array(shard.owners, dtype=np.int32), shard.ranks)
        facts = [m.identity(), int(shard is not None), 0 if mine is None else mine.fingerprint()]
        facts += [-1, -1] if shard is None else [shard.rank, shard.ranks]
        check_vaults(await _collective(watched, group.gather, facts), group.size)
        if mine is None:  # full vaults: rank 0's assignment, balanced by its history
            mine = ExpertAssignment.balanced(list(layers), m.num_experts, group.size, popularity)
            owners = await _collective(watched, group.from_rank0, mine.owners)
            mine = ExpertAssignment(layers, owners.astype(np.int32), group.size)
        return cls(group, mine, compute, watchdog)

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

        start = time.perf_counter()
        with self.watchdog.watch("the sum of a MoE layer's expert outputs"):
            y = self.group.all_sum(y)
            mx.eval(y)
        self.sums += 1
        self.sum_seconds += time.perf_counter() - start
        self.sum_bytes += int(y.nbytes)
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

    async def broadcast(self, payload: bytes | None) -> bytes:
        """Rank 0's ``payload`` on every rank (the others pass None). Rank 0's wait is
        watched; another rank's is not: it waits as long as rank 0 is idle."""
        compute = _Watched(self._compute, self.watchdog) if self.rank == 0 else self._compute
        return bytes(await _collective(compute, self._broadcast, payload))

    def _broadcast(self, payload: bytes | None) -> bytes:
        """Compute thread: the length, then the bytes (as int64 values: a sum)."""
        length = int(self.group.from_rank0(np.array([0 if payload is None else len(payload)]))[0])
        mine = np.zeros(length, np.int64)
        if payload is not None:
            mine = np.frombuffer(payload, dtype=np.uint8).astype(np.int64)
        return bytes(self.group.from_rank0(mine).astype(np.uint8).tobytes())

    async def gather(self, values: list[int]) -> np.ndarray:
        """[size, n]: every rank's ``values``, in rank order."""
        watched = _Watched(self._compute, self.watchdog)
        return np.asarray(await _collective(watched, self.group.gather, values))


def check_vaults(facts: np.ndarray, size: int) -> None:
    """Every rank's [vault identity, is a shard, cut's fingerprint, shard's rank, shard's
    ranks], checked alike on every rank: GroupError naming the first rank that differs."""
    first = facts[0].tolist()
    for r, row in enumerate(facts.tolist()):
        if row[0] != first[0]:
            raise GroupError(
                f"rank {r} opened another model than rank 0; give every rank the same vault "
                "(or shards cut from it with smoe shard)"
            )
        if row[1] != first[1] or row[2] != first[2]:
            raise GroupError(
                f"rank {r} and rank 0 opened shards of different cuts (or a shard and a full "
                f"vault); cut every rank's shard with the same 'smoe shard --ranks {size}'"
            )
        if row[1] and (row[3] != r or row[4] != size):
            raise GroupError(
                f"rank {r} of {size} opened the shard cut for rank {row[3]} of {row[4]}; give "
                f"it the shard cut with 'smoe shard VAULT OUT --ranks {size} --rank {r}'"
            )


def io_by_rank(rows: np.ndarray, owned: list[int]) -> list[dict[str, Any]]:
    """Rows of [hits, misses, bytes read, microseconds waiting for reads, sums over ranks,
    microseconds in them, bytes summed] per rank, as reported."""
    out = []
    for rank, (hits, misses, read, wait_us, sums, sum_us, summed) in enumerate(rows.tolist()):
        out.append(
            {
                "rank": rank,
                "experts_owned": owned[rank],
                "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
                "bytes_read": read,
                "io_wait_s": wait_us / 1e6,
                "collectives": sums,
                "collective_s": sum_us / 1e6,
                "collective_bytes": summed,
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
