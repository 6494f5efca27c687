"""The expert-parallel part of ``Engine``'s API (docs/distributed.md): a ``Group`` the
engine holds once its parts are open (composition: it reads the parts it is given, and
``Engine``'s ``from_rank0``, ``rank_stats``, ``lead`` and ``follow`` call it). Without
ranks it answers for this process alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from smoe.compute.runner import SamplingParams, Sequence_
from smoe.engine.mirror import Follower, Leader, Sequences, follow
from smoe.engine.ranks import Ranks, io_by_rank
from smoe.errors import SmoeError
from smoe.parallel.doorbell import Bell, Door, rank0_address

if TYPE_CHECKING:
    from smoe.engine.build import EngineParts

# Engine.point: a sequence (or a new one) pointed at a prompt, and the tokens to prefill.
Point = Callable[[Sequence_ | None, list[int], SamplingParams], tuple[Sequence_, int]]


class Group:
    """Collectives, per-rank figures, and rank 0 leading the others. Event loop only."""

    def __init__(
        self,
        parts: EngineParts,
        num_records: int,
        lock: asyncio.Lock,
        point: Point,
        stack: contextlib.AsyncExitStack,
    ) -> None:
        self.ranks: Ranks | None = parts.ranks
        self.leader: Leader | None = None  # set by ``lead``
        self.batcher = parts.batcher
        self.scheduler = parts.scheduler
        self.slots = parts.slots
        self.num_records = num_records
        self._lock = lock
        self.point = point
        self._stack = stack  # the engine's: a leader's doorbell closes with it

    async def from_rank0(self, value: int) -> int:
        """Rank 0's ``value`` on every rank (``value`` itself without ranks). A collective:
        every rank calls it at the same point. GroupError if the group broke."""
        if self.ranks is None:
            return value
        async with self._lock:
            return await self.ranks.from_rank0(value)

    async def rank_stats(self) -> list[dict[str, Any]]:
        """Each rank's I/O so far, in rank order (this process's alone without ranks):
        experts owned, hit rate, bytes read, seconds waiting for reads, and the layer sums
        over ranks with their seconds. A collective, as ``from_rank0``."""
        if self.ranks is None:
            return io_by_rank(np.array([self._my_io()]), [self.num_records])
        if self.leader is not None:  # the followers join it at the next iteration's start
            rows = await self.leader.gather(self.batcher)
        else:
            async with self._lock:
                rows = await self.ranks.gather(self._my_io())
        return io_by_rank(rows, self.ranks.owned_counts())

    def _my_io(self) -> list[int]:
        """This rank's row of ``rank_stats`` (ranks.io_by_rank reads it)."""
        s = self.scheduler.stats
        mine = [s.hits, s.misses, s.bytes_read(), int(self.slots.wait_seconds * 1e6), 0, 0, 0]
        if self.ranks is not None:
            r = self.ranks
            mine[4:] = [r.sums, int(r.sum_seconds * 1e6), r.sum_bytes]
        return mine

    async def lead(self) -> None:
        """Rank 0: from now on, announce every request to the other ranks, which run them
        too (``follow``, which they call at the same time): for chat and serve, where only
        rank 0 hears the users. Work the others cannot mirror is then refused (teacher-
        forced logits, conversation cache saves and loads). SmoeError without ranks or on
        another rank; GroupError if the others do not connect (parallel/doorbell.py)."""
        if self.ranks is None or self.ranks.rank != 0:
            raise SmoeError("only rank 0 of a distributed engine leads")
        ranks = self.ranks
        bell = await Bell.open(ranks.size - 1)
        try:
            where = {"host": rank0_address(), "port": bell.port}
            async with self._lock:
                await ranks.broadcast(json.dumps(where).encode())
            await bell.wait_for_followers()
        except BaseException:
            await bell.close()
            raise
        gather = lambda: ranks.gather(self._my_io())  # noqa: E731 - a rank's row, on demand
        self.leader = Leader(ranks.broadcast, Sequences(), gather, bell)
        self.batcher.coordinator = self.leader
        batcher = self.batcher

        async def stop_leading() -> None:  # the batcher tells the followers first
            await batcher.close()
            await bell.close()

        self._stack.push_async_callback(stop_leading)

    async def follow(self) -> None:
        """Another rank: run rank 0's requests (it called ``lead``) until it ends the
        group. Raises this rank's error if one of its passes failed, GroupError if the
        group broke. Cancelling it leaves the ranks out of step: end the process."""
        if self.ranks is None or self.ranks.rank == 0:
            raise SmoeError("rank 0 leads; the other ranks of a distributed engine follow")

        def prepare(seq: Sequence_ | None, ids: list[int], fields: dict[str, Any]) -> Sequence_:
            return self.point(seq, ids, SamplingParams(**fields))[0]

        ranks = self.ranks
        async with self._lock:
            where = json.loads(await ranks.broadcast(None))
        door = await Door.connect(str(where["host"]), int(where["port"]), ranks.rank)
        gather = lambda: ranks.gather(self._my_io())  # noqa: E731 - a rank's row, on demand
        await follow(self.batcher, Follower(ranks.broadcast, prepare, gather, door))

    def refuse_while_leading(self, what: str) -> None:
        """SmoeError naming ``what`` while other ranks follow this one (they could not
        mirror it)."""
        if self.leader is not None:
            raise SmoeError(f"{what} is not available while other ranks follow rank 0")
