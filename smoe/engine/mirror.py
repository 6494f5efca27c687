"""Rank 0's requests, run on every rank (expert parallelism, docs/distributed.md).

Each forward pass sums its MoE layers over the ranks, so every rank must run the same
passes in the same order. For `smoe chat` and `smoe serve` only rank 0 hears the users.
At the start of each batcher iteration, rank 0's ``Leader`` sends the other ranks what has
changed since the last one:
- the requests announced (prompt ids, sampling, length, EOS ids, and which cached sequence
  each continues);
- the requests cancelled;
- the sequences rank 0 has dropped;
- a gather of every rank's I/O figures (``engine.group.rank_stats``, the server's /stats);
- or the end of the group.

Each ``Follower`` applies the same changes to its own batcher, then runs the same
iteration. The batcher's choices (admission, the prefill chunk, the decode rows) are pure
functions of those states, so every rank makes the same ones, and samples the same tokens
from the same logits and seeds.

Failures:
- **A rank's pass fails** (its disk). The ranks' sums are then out of step. That rank
  stops taking part: a follower leaves ``follow`` with the error; rank 0 refuses all further
  work with a GroupError. The others' next sum fails or times out (smoe/parallel/watchdog.py).
- **Unsupported on rank 0.** Work that would not be mirrored is refused with a SmoeError:
  teacher-forced logits, and saving or loading a conversation's cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from smoe.engine.batcher import Batcher, Ticket
from smoe.errors import GroupError, SmoeError
from smoe.parallel.doorbell import Bell, Door

END = "end"


@dataclass(frozen=True)
class Request:
    """What another rank needs to run a ticket as rank 0 runs it."""

    sequence: int  # the cached sequence it continues, or the id its new sequence gets
    new: bool  # whether ``sequence`` is made now (else it exists on every rank)
    ids: list[int]
    params: dict[str, Any]  # SamplingParams' fields
    max_tokens: int
    eos: list[int]


class Sequences:
    """Rank 0's names for its sequences, and the drops to announce (thread-safe: a
    sequence may be dropped on the compute thread or the event loop)."""

    def __init__(self) -> None:
        self._next = 0
        self._lock = threading.Lock()
        self._dropped: list[int] = []

    def name(self, seq: Any) -> int:
        """``seq``'s name, given it (and a drop notice for when it goes) at first sight."""
        existing = getattr(seq, "mirror_id", None)
        if existing is not None:
            return int(existing)
        with self._lock:
            self._next += 1
            number = self._next
        seq.mirror_id = number
        weakref.finalize(seq, self._drop, number)
        return number

    def reserve(self) -> int:
        """A name for a sequence that a request will make."""
        with self._lock:
            self._next += 1
            return self._next

    def adopt(self, seq: Any, number: int) -> None:
        """Give the sequence a request made (``reserve``) its name."""
        seq.mirror_id = number
        weakref.finalize(seq, self._drop, number)

    def _drop(self, number: int) -> None:
        with self._lock:
            self._dropped.append(number)

    def take_dropped(self) -> list[int]:
        with self._lock:
            dropped, self._dropped = self._dropped, []
        return dropped


class Leader:
    """Rank 0's side: announces each iteration's changes (a collective per iteration)."""

    leads = True

    def __init__(
        self,
        exchange: Callable[[bytes | None], Any],
        sequences: Sequences,
        gather: Callable[[], Any],
        bell: Bell,
    ) -> None:
        self._exchange = exchange  # async: rank 0's message on every rank
        self.bell = bell  # rung before each message: the others wait for it at no cost
        self._gather = gather  # async: every rank's I/O row (engine.group.rank_stats)
        self.sequences = sequences
        self._gathers: list[asyncio.Future[Any]] = []  # rank_stats calls waiting
        self.broken: BaseException | None = None
        self.tickets: dict[int, Ticket] = {}  # announced and not finished

    def describe(
        self, sequence: Any, ids: list[int], params: Any, max_tokens: int, eos: frozenset[int]
    ) -> Request:
        """The request for another rank: ``sequence`` is None (a new one) or a sequence
        rank 0 made while leading. SmoeError for one made before (no rank knows it)."""
        if sequence is None:
            number, new = self.sequences.reserve(), True
        elif getattr(sequence, "mirror_id", None) is not None:
            number, new = int(sequence.mirror_id), False
        else:
            raise SmoeError(
                "this sequence was made before the ranks followed rank 0; start a new one"
            )
        fields = dataclasses.asdict(params)
        return Request(number, new, list(ids), fields, max_tokens, sorted(eos))

    def admit(self, batcher: Batcher, ticket: Ticket) -> None:
        """A ticket waits until an iteration's start has announced it."""
        batcher.incoming.append(ticket)

    def gone(self, ticket: Ticket) -> bool:
        """A cancel acts once announced (``leaving``): every rank drops it together."""
        return ticket.leaving

    def pending(self) -> bool:
        """Whether an iteration must run even with no request (a gather is waiting)."""
        return bool(self._gathers)

    async def gather(self, batcher: Batcher) -> Any:
        """Every rank's I/O row, gathered at the start of the next iteration (one is run
        for it if the batcher is idle)."""
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._gathers.append(done)
        batcher.wake()
        return await done

    async def start(self, batcher: Batcher) -> None:
        """Announce the tickets submitted and cancelled since the last iteration, and the
        sequences dropped; then let the batcher take the new ones."""
        if self.broken is not None:
            raise GroupError(
                f"the expert-parallel group stopped after a failure ({self.broken}); restart every rank"
            )
        self.bell.check()  # before taking anything: the batcher fails what it holds
        changes: list[dict[str, Any]] = []
        new = list(batcher.incoming)
        batcher.incoming.clear()
        for ticket in new:
            changes.append(
                {"kind": "request", "ticket": ticket.number, **dataclasses.asdict(ticket.request)}
            )
            self.tickets[ticket.number] = ticket
        for ticket in [*batcher.waiting, *batcher.active, *new]:
            if ticket.cancelled and not ticket.leaving:
                ticket.leaving = True
                changes.append({"kind": "cancel", "ticket": ticket.number})
        for number in self.sequences.take_dropped():
            changes.append({"kind": "forget", "sequence": number})
        gathers, self._gathers = self._gathers, []
        if gathers:
            changes.append({"kind": "gather"})
        await self.bell.ring()
        await self._exchange(json.dumps(changes).encode())
        batcher.waiting.extend(new)
        if gathers:
            try:
                rows = await self._gather()
            except BaseException as e:
                for done in gathers:
                    done.set_exception(e)
                raise
            for done in gathers:
                done.set_result(rows)

    async def end(self, batcher: Batcher) -> None:
        """Tell the other ranks to stop, between iterations (no rank is inside a pass)."""
        async with batcher.lock:
            if self.broken is None and self.bell.lost is None:  # else nobody is left to tell
                await self.bell.ring()
                await self._exchange(json.dumps([{"kind": END}]).encode())

    def check(self, batcher: Batcher) -> None:
        """After an iteration: a failed request may have left the ranks' sums out of step
        (a read failed inside a pass), so no further collective is safe."""
        for ticket in self.tickets.values():
            if ticket.error is not None and self.broken is None:
                self.broken = ticket.error
        self.tickets = {n: t for n, t in self.tickets.items() if not t.finished}


class Follower:
    """Another rank's side: applies rank 0's announcements to its own batcher."""

    leads = False

    def __init__(
        self,
        exchange: Callable[[bytes | None], Any],
        prepare: Callable[[Any, list[int], dict[str, Any]], Any],
        gather: Callable[[], Any],
        door: Door,
    ) -> None:
        self._exchange = exchange
        self._door = door  # rank 0 rings it before each message
        self._prepare = prepare  # compute thread: (sequence or None, ids, params) -> sequence
        self._gather = gather  # async: join rank 0's gather of every rank's I/O row
        self.sequences: dict[int, Any] = {}
        self.tickets: dict[int, Ticket] = {}

    def admit(self, batcher: Batcher, ticket: Ticket) -> None:
        raise SmoeError("a rank that follows rank 0 runs rank 0's requests only")

    def gone(self, ticket: Ticket) -> bool:
        return ticket.leaving  # as rank 0 announced it

    def pending(self) -> bool:
        return False  # a follower runs iterations when rank 0 announces them

    def check(self, batcher: Batcher) -> None:
        return None  # ``follow`` raises a failed pass's error itself

    async def end(self, batcher: Batcher) -> None:
        return None  # rank 0 ends the group; this rank leaves ``follow`` then

    async def close(self) -> None:
        await self._door.close()

    async def start(self, batcher: Batcher) -> None:
        """Run by ``follow`` itself (``apply``), not by the batcher's loop."""
        raise SmoeError("a following rank's iterations start in follow()")

    async def apply(self, batcher: Batcher) -> bool:
        """Wait for rank 0's next announcement and apply it; False at the group's end."""
        await self._door.wait()  # idle here, in the event loop, not inside a collective
        changes = json.loads(bytes(await self._exchange(None)).decode())
        for change in changes:
            kind = change.pop("kind")
            if kind == END:
                return False
            if kind == "gather":
                await self._gather()
            if kind == "request":
                number = change.pop("ticket")
                request = Request(**change)
                ticket = Ticket(
                    self._prepare_for(request), request.max_tokens, frozenset(request.eos)
                )
                ticket.number = number
                self.tickets[number] = ticket
                batcher.waiting.append(ticket)
            elif kind == "cancel":
                gone = self.tickets.get(change["ticket"])
                if gone is not None:
                    gone.cancelled = gone.leaving = True
            elif kind == "forget":
                self.sequences.pop(change["sequence"], None)
        self.tickets = {n: t for n, t in self.tickets.items() if not t.finished}
        return True

    def _prepare_for(self, request: Request) -> Callable[[], Any]:
        def prepare() -> Any:  # compute thread, as the batcher admits the ticket
            seq = None if request.new else self.sequences[request.sequence]
            seq = self._prepare(seq, request.ids, request.params)
            self.sequences[request.sequence] = seq
            return seq

        return prepare


async def follow(batcher: Batcher, follower: Follower) -> None:
    """Run rank 0's iterations until it ends the group. Raises the error of a failed pass
    on this rank (the ranks are out of step after it), or GroupError if the group broke."""
    alone, batcher.coordinator = batcher.coordinator, follower
    try:
        while True:
            async with batcher.lock:
                if not await follower.apply(batcher):
                    return
                await batcher.iterate()
                for ticket in follower.tickets.values():
                    if ticket.error is not None:
                        raise ticket.error
    finally:
        batcher.coordinator = alone  # this rank decides alone again (closing, for one)
        await follower.close()
