"""One process or several ranks, chosen once when the engine's parts are built
(``make_group``): ``Engine.group`` answers every question that depends on it, so no other
module asks which it is (as anyio picks its backend once behind one interface).

- ``Alone``: this process computes every expert and talks to the user.
- ``AcrossRanks``: expert parallelism (docs/distributed.md): this rank's experts only; rank
  0 talks to the user and, once it ``lead``s, announces every request to the other ranks,
  which ``follow`` it (smoe.engine.mirror).

Event loop only; collectives run on the compute thread (smoe.engine.ranks).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import numpy as np

from smoe.compute.runner import Runner
from smoe.compute.sequence import Sequence_
from smoe.engine.mirror import Follower, Leader, Request, Sequences, follow
from smoe.engine.ranks import Ranks, io_by_rank
from smoe.errors import SmoeError
from smoe.parallel.doorbell import Bell, Door, rank0_address
from smoe.sampling import SamplingParams

if TYPE_CHECKING:
    from smoe.engine.build import EngineParts


def point(
    runner: Runner, sequence: Sequence_ | None, ids: list[int], params: SamplingParams
) -> tuple[Sequence_, int]:
    """Compute thread only: ``sequence`` (or a new one) pointed at ``ids``, keeping the
    cached prefix they share (``Runner.prepare``); returns it and how many prompt tokens
    remain to prefill."""
    seq = sequence if sequence is not None else Sequence_(cache=runner.new_cache())
    return seq, runner.prepare(seq, ids, params)


class Group(ABC):
    """What one process or a group of ranks does differently. Event loop only."""

    def __init__(self, parts: EngineParts, num_records: int) -> None:
        self._parts = parts
        self._num_records = num_records

    @property
    @abstractmethod
    def speaks(self) -> bool:
        """Whether this process talks to the user: one process, or rank 0 of several (the
        other ranks run the same requests silently)."""

    @property
    @abstractmethod
    def distributed(self) -> bool:
        """Whether experts are shared among ranks (``size`` > 1 processes)."""

    @property
    def rank(self) -> int:
        """This process's rank (0 alone)."""
        return 0

    @property
    def size(self) -> int:
        """Processes in the group (1 alone)."""
        return 1

    @property
    def leading(self) -> bool:
        """Whether other ranks follow this one (``lead``): work they could not mirror is
        then refused."""
        return False

    @property
    def whole_model(self) -> bool:
        """Whether this process computes every expert (a ring of them all may then serve
        the model from device tables, and ``Learning.load_all`` may fill it)."""
        return not self.distributed

    def owns(self, layer: int, expert: int) -> bool:
        """Whether this process computes ``expert`` of ``layer`` (pre-warm reads only those)."""
        return True

    async def from_rank0(self, value: int) -> int:
        """Rank 0's ``value`` on every rank (``value`` itself alone). A collective: every
        rank calls it at the same point. GroupError if the group broke."""
        return value

    async def rank_stats(self) -> list[dict[str, Any]]:
        """Each rank's I/O so far, in rank order (this process's alone): experts owned, hit
        rate, bytes read, seconds waiting for reads, and the layer sums over ranks with
        their seconds. A collective, as ``from_rank0``."""
        return io_by_rank(np.array([self._my_io()]), [self._num_records])

    async def lead(self) -> None:
        """Rank 0: announce every request to the other ranks, which run them too (they call
        ``follow``): for chat and serve, where only rank 0 hears the users. SmoeError
        alone or on another rank; GroupError if the others do not connect."""
        raise SmoeError("only rank 0 of a distributed engine leads")

    async def follow(self) -> None:
        """Another rank: run rank 0's requests until it ends the group. Raises this rank's
        error if one of its passes failed, GroupError if the group broke; SmoeError alone
        or on rank 0. Cancelling it leaves the ranks out of step: end the process."""
        raise SmoeError("rank 0 leads; the other ranks of a distributed engine follow")

    def refuse_while_leading(self, what: str) -> None:
        """SmoeError naming ``what`` while other ranks follow this one (they could not
        mirror it)."""
        if self.leading:
            raise SmoeError(f"{what} is not available while other ranks follow rank 0")

    def request(
        self,
        sequence: Sequence_ | None,
        ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos: frozenset[int],
    ) -> tuple[SamplingParams, Request | None]:
        """The sampling a request runs with, and what the other ranks run (None alone).
        SmoeError where the ranks could not sample alike."""
        return params, None

    def adopt(self, seq: Sequence_, request: Request | None) -> None:
        """Compute thread: a request's new sequence named for the other ranks."""
        return None

    def _my_io(self) -> list[int]:
        """This process's row of ``rank_stats`` (ranks.io_by_rank reads it)."""
        s = self._parts.scheduler.stats
        wait_us = int(self._parts.slots.wait_seconds * 1e6)
        return [s.hits, s.misses, s.bytes_read(), wait_us, 0, 0, 0]


class Alone(Group):
    """One process: every expert here, every answer local."""

    @property
    def speaks(self) -> bool:
        return True

    @property
    def distributed(self) -> bool:
        return False


class AcrossRanks(Group):
    """This rank's share of an expert-parallel group (docs/distributed.md)."""

    def __init__(
        self,
        parts: EngineParts,
        ranks: Ranks,
        num_records: int,
        lock: asyncio.Lock,
        stack: contextlib.AsyncExitStack,
    ) -> None:
        super().__init__(parts, num_records)
        self._ranks = ranks
        self._leader: Leader | None = None  # set by ``lead``
        self._lock = lock
        self._stack = stack  # the engine's: a leader's doorbell closes with it

    @property
    def speaks(self) -> bool:
        return self._ranks.rank == 0

    @property
    def distributed(self) -> bool:
        return True

    @property
    def rank(self) -> int:
        return self._ranks.rank

    @property
    def size(self) -> int:
        return self._ranks.size

    @property
    def leading(self) -> bool:
        return self._leader is not None

    def owns(self, layer: int, expert: int) -> bool:
        return self._ranks.owns(layer, expert)

    async def from_rank0(self, value: int) -> int:
        async with self._lock:
            return await self._ranks.from_rank0(value)

    async def rank_stats(self) -> list[dict[str, Any]]:
        if self._leader is not None:  # the followers join it at the next iteration's start
            rows = await self._leader.gather(self._parts.batcher)
        else:
            async with self._lock:
                rows = await self._ranks.gather(self._my_io())
        return io_by_rank(rows, self._ranks.owned_counts())

    def _my_io(self) -> list[int]:
        r = self._ranks
        return [*super()._my_io()[:4], r.sums, int(r.sum_seconds * 1e6), r.sum_bytes]

    async def lead(self) -> None:
        if self._ranks.rank != 0:
            await super().lead()
        ranks = self._ranks
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
        self._leader = Leader(ranks.broadcast, Sequences(), gather, bell)
        batcher = self._parts.batcher
        batcher.coordinator = self._leader

        async def stop_leading() -> None:  # the batcher tells the followers first
            await batcher.close()
            await bell.close()

        self._stack.push_async_callback(stop_leading)

    async def follow(self) -> None:
        if self._ranks.rank == 0:
            await super().follow()
        runner = self._parts.runner

        def prepare(seq: Sequence_ | None, ids: list[int], fields: dict[str, Any]) -> Sequence_:
            return point(runner, seq, ids, SamplingParams(**fields))[0]

        ranks = self._ranks
        async with self._lock:
            where = json.loads(await ranks.broadcast(None))
        door = await Door.connect(str(where["host"]), int(where["port"]), ranks.rank)
        gather = lambda: ranks.gather(self._my_io())  # noqa: E731 - a rank's row, on demand
        await follow(self._parts.batcher, Follower(ranks.broadcast, prepare, gather, door))

    def request(
        self,
        sequence: Sequence_ | None,
        ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos: frozenset[int],
    ) -> tuple[SamplingParams, Request | None]:
        if params.temperature > 0 and params.seed is None:
            if self._leader is None:
                raise SmoeError(
                    "ranks sample the same tokens only from the same seed: give a seed "
                    "(smoe generate --seed N) or sample greedily"
                )
            # Leading: rank 0 picks the seed, and announces it with the request.
            params = dataclasses.replace(params, seed=secrets.randbits(31))
        if self._leader is None:
            return params, None
        return params, self._leader.describe(sequence, ids, params, max_tokens, eos)

    def adopt(self, seq: Sequence_, request: Request | None) -> None:
        if self._leader is not None and request is not None and request.new:
            self._leader.sequences.adopt(seq, request.sequence)


def make_group(
    parts: EngineParts,
    ranks: Ranks | None,
    num_records: int,
    lock: asyncio.Lock,
    stack: contextlib.AsyncExitStack,
) -> Group:
    """The group an engine's parts were built for: ``Alone`` without ranks."""
    if ranks is None:
        return Alone(parts, num_records)
    return AcrossRanks(parts, ranks, num_records, lock, stack)
