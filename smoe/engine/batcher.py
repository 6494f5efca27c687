"""Continuous batching: the active generations advance together, one token per step.

The batcher owns the engine's generation work on the compute thread. Each iteration runs
under the engine lock (so ``Engine.logits``, conversation saves and the like slip in
between iterations) and does, in order:

1. admit waiting requests while fewer than ``max_batch`` are active: run their
   ``prepare`` (set the sampler, trim the cache to the reused prefix; no model work);
2. run one prefill chunk of the oldest request still prefilling, so a long prompt delays
   the others' next token by one chunk at a time, not by its whole prefill;
3. run one decode step of every request ready to sample, as one batched pass
   (``Runner.step_batch``: per MoE layer the union of their experts is read once); a
   request decoding alone, with drafting on, takes a drafted step instead (``draft``:
   ``Runner.step_draft``, 1 to k+1 tokens from one pass; docs/draft.md).

Which requests steps 2 and 3 take is decided by ``next_prefill`` and ``ready_to_decode``,
pure functions of the active tickets' states (as nano-vllm separates scheduling from running). A ticket moves
WAITING -> PREFILLING -> DECODING -> FINISHED (or straight to FINISHED on an error or a
cancel). Its events, typed (``Token``, ``Prompt``, ``End``, ``Failed``), go to its own
queue, which ``Engine._stream`` reads. A ticket of max_tokens 0 ends once its prompt is
prefilled (with its ``Prompt`` log-probabilities, where asked). A cancelled ticket leaves the batch at the next iteration; the
step in progress (one token's time) cannot be interrupted. Nothing here imports MLX: the
runner does the math.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import anyio

from smoe.errors import SmoeError

log = logging.getLogger("smoe.engine.batcher")


@dataclass
class Meter:
    """Engine-wide counters read around each job to attribute I/O to requests."""

    bytes_read: int = 0
    hits: int = 0
    misses: int = 0
    wait_s: float = 0.0
    experts: int = 0  # distinct experts summed over (pass, MoE layer)
    copy_s: float = 0.0  # compute thread committing landed records (a staged ring)
    bus_bytes: int = 0  # copied up from the host tier (smoe.io.host_tier)

    def add(self, cost: Meter, rows: int = 1) -> None:
        """Count ``cost`` here, with a ``rows``-th of its bytes: one read served every row
        of a step that used it."""
        self.bytes_read += cost.bytes_read // rows
        self.bus_bytes += cost.bus_bytes // rows
        self.hits += cost.hits
        self.misses += cost.misses
        self.wait_s += cost.wait_s
        self.experts += cost.experts
        self.copy_s += cost.copy_s

    def __sub__(self, other: Meter) -> Meter:
        return Meter(
            self.bytes_read - other.bytes_read,
            self.hits - other.hits,
            self.misses - other.misses,
            self.wait_s - other.wait_s,
            self.experts - other.experts,
            self.copy_s - other.copy_s,
            self.bus_bytes - other.bus_bytes,
        )


class RequestState(enum.Enum):
    WAITING = "waiting"  # submitted, not admitted to the batch
    PREFILLING = "prefilling"  # admitted; prompt tokens left to run
    DECODING = "decoding"  # sampling one token per step
    FINISHED = "finished"  # ended, failed or cancelled: its last event is queued


class Token(NamedTuple):
    """A sampled token id, with its log-probability where the request asked
    (``SamplingParams.logprobs``: a smoe.sampling.TokenLogprob)."""

    id: int
    score: Any = None


class Prompt(NamedTuple):
    """The prompt's log-probabilities (``SamplingParams.prompt_logprobs``), once its
    prefill is done, before any token: a TokenLogprob per prompt token after the first."""

    scores: list[Any]


class End(NamedTuple):
    """The generation ended: ``reason`` is "stop" (an EOS id) or "length"."""

    reason: str


class Failed(NamedTuple):
    """The generation failed with ``error`` (raised to the consumer)."""

    error: BaseException


TicketEvent = Token | Prompt | End | Failed


@dataclass
class Ticket:
    """One generation request in the batcher. ``prepare`` runs on the compute thread and
    returns the sequence pointed at its prompt (``Runner.prepare`` done)."""

    prepare: Callable[[], Any]
    max_tokens: int
    eos: frozenset[int] = frozenset()
    events: asyncio.Queue[TicketEvent] = field(default_factory=asyncio.Queue)
    seq: Any = None
    state: RequestState = RequestState.WAITING
    generated: int = 0
    cancelled: bool = False  # asked by the consumer; acted on at the next iteration
    # Whether the batcher acts on the cancel: at once alone; across ranks only from the
    # iteration whose start told every rank (smoe/engine/mirror.py).
    leaving: bool = False
    number: int = 0  # the batcher's count of submitted tickets: its name across ranks
    request: Any = None  # what the other ranks need to run it too (mirror.Request)
    error: BaseException | None = None  # why it failed, if it did
    prompt_run: int = 0  # prompt tokens to prefill (the rest of the prompt was reused)
    # What this request cost: its prefill chunks and first step (time to first token),
    # then its decode steps; bytes of a batched step are shared among its rows.
    prefill: Meter = field(default_factory=Meter)
    decode: Meter = field(default_factory=Meter)
    batch_sizes: list[int] = field(default_factory=list)  # rows of each decode step
    submitted: float = field(default_factory=time.perf_counter)

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

    def cancel(self) -> None:
        """Leave the batch at the next iteration (idempotent)."""
        self.cancelled = True

    def _finish(self, last: End | Failed) -> None:
        if not self.finished:
            self.state = RequestState.FINISHED
            if isinstance(last, Failed):
                self.error = last.error
            self.events.put_nowait(last)


def next_prefill(active: list[Ticket]) -> Ticket | None:
    """Pure: the oldest admitted ticket with prompt tokens left, which gets one chunk."""
    return next((t for t in active if t.state is RequestState.PREFILLING), None)


def ready_to_decode(active: list[Ticket]) -> list[Ticket]:
    """Pure: every ticket ready to sample; they advance together, one batched step."""
    return [t for t in active if t.state is RequestState.DECODING]


class Coordinator(Protocol):
    """How a batcher's iterations are agreed: ``Solo`` for one process; across ranks, rank
    0's ``Leader`` and the others' ``Follower`` (smoe.engine.mirror). Event loop only."""

    def admit(self, batcher: Batcher, ticket: Ticket) -> None:
        """Queue a submitted ticket where it waits for its first iteration."""

    def pending(self) -> bool:
        """Whether an iteration must run even with no request."""

    async def start(self, batcher: Batcher) -> None:
        """Before an iteration (under the lock)."""

    def check(self, batcher: Batcher) -> None:
        """After an iteration (under the lock)."""

    async def end(self, batcher: Batcher) -> None:
        """``Batcher.close``: before the loop stops (takes the lock where it needs one)."""

    def gone(self, ticket: Ticket) -> bool:
        """Whether the batcher acts on the ticket's cancel now (module docstring)."""


class Solo:
    """One process deciding each iteration alone: a ticket waits in ``waiting`` at once
    and a cancel takes effect at the next iteration."""

    def admit(self, batcher: Batcher, ticket: Ticket) -> None:
        batcher.waiting.append(ticket)

    def pending(self) -> bool:
        return False

    async def start(self, batcher: Batcher) -> None:
        return None

    def check(self, batcher: Batcher) -> None:
        return None

    async def end(self, batcher: Batcher) -> None:
        return None

    def gone(self, ticket: Ticket) -> bool:
        return ticket.cancelled


class Batcher:
    """Schedules tickets onto the compute thread (see the module docstring).

    ``compute.run(fn, *args)`` awaits ``fn`` on the compute thread; ``runner`` has
    ``prefill_chunk(seq)``, ``to_prefill`` on sequences, and ``step_batch(seqs)``;
    ``meter()`` reads the engine-wide counters; ``on_demand()`` runs when a request is
    admitted (drops queued speculative reads); ``on_idle()`` when the last one leaves.
    """

    def __init__(
        self,
        compute: Any,
        runner: Any,
        lock: asyncio.Lock,
        meter: Callable[[], Meter],
        max_batch: int = 8,
        on_demand: Callable[[], None] | None = None,
        on_idle: Callable[[], object] | None = None,
        draft: Callable[[Any, int, frozenset[int]], list[int]] | None = None,
        timeline: Any = None,
    ) -> None:
        if max_batch < 1:
            raise SmoeError("max_batch must be at least 1")
        self.compute = compute
        self.runner = runner
        self.lock = lock
        self.meter = meter
        self.max_batch = max_batch
        self.on_demand = on_demand
        self.on_idle = on_idle
        # draft(seq, budget, eos): a lone decoding request's step with a verified draft
        # (Runner.step_draft); it returns 1..budget tokens. None: plain steps only.
        self.draft = draft
        # The loop's share of each decode step (smoe.compute.timeline.StepTimeline), if given.
        self.timeline = timeline
        self.waiting: collections.deque[Ticket] = collections.deque()
        self.active: list[Ticket] = []
        self.steps = 0  # batched decode passes run
        self.step_rows = 0  # sequences advanced by them
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._stop = anyio.CancelScope()  # close() cancels the loop through it
        self._closed = False
        self.submitted = 0
        # Across ranks (smoe/engine/mirror.py) rank 0's coordinator tells the others what
        # each iteration starts with; ``Solo``: this process decides alone.
        self.coordinator: Coordinator = Solo()
        self.incoming: collections.deque[Ticket] = collections.deque()  # not yet announced

    # ------------------------------------------------------------------ interface
    def submit(self, ticket: Ticket) -> Ticket:
        """Queue ``ticket``; its events arrive on ``ticket.events``."""
        if self._closed:
            raise SmoeError("the engine is closed")
        self.submitted += 1
        ticket.number = self.submitted
        self.coordinator.admit(self, ticket)  # across ranks: once an iteration announced it
        self.wake()
        return ticket

    @property
    def queued(self) -> int:
        """Requests submitted but not yet admitted to the batch."""
        return sum(1 for t in [*self.incoming, *self.waiting] if not t.cancelled)

    def wake(self) -> None:
        """Run an iteration soon even with no request (a coordinator has work for one)."""
        self._idle.clear()
        self._wake.set()
        if self._task is None or self._task.done():
            self._stop = anyio.CancelScope()
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="smoe-batcher")

    async def wait_idle(self) -> None:
        """Until no request is waiting or active."""
        await self._idle.wait()

    async def close(self, error: SmoeError | None = None) -> None:
        """Stop the loop after the job in progress; every unfinished ticket gets ``error``
        (default: SmoeError "the engine closed during the request"). Across ranks, the
        iteration in progress completes first (every rank runs it) and the other ranks are
        told to stop, once. Idempotent: a second call returns at once."""
        if self._closed:
            return
        self._closed = True
        await self.coordinator.end(self)
        if self._task is not None:
            self._stop.cancel()  # the loop leaves its scope at its next await and returns
            await self._task
        for t in [*self.active, *self.waiting, *self.incoming]:
            t._finish(Failed(error or SmoeError("the engine closed during the request")))
        self.active.clear()
        self.waiting.clear()
        self.incoming.clear()
        self._idle.set()

    # ------------------------------------------------------------------ the loop
    async def _loop(self) -> None:
        with self._stop:
            await self._serve()

    async def _serve(self) -> None:
        while True:
            pending = self.coordinator.pending()
            if not self.waiting and not self.active and not self.incoming and not pending:
                self._idle.set()
                if self.on_idle is not None:
                    try:
                        self.on_idle()
                    except Exception:  # an optional nicety: never the loop's end
                        log.exception("on_idle failed")
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self.lock:
                if self._closed:  # across ranks: close() ends the group between iterations
                    return
                try:
                    await self.coordinator.start(self)
                    await self._iteration()
                    self.coordinator.check(self)
                except Exception as e:  # a bug here must not leave requests hanging
                    for t in [*self.active, *self.waiting, *self.incoming]:
                        t._finish(Failed(e))
                    self.active.clear()
                    self.waiting.clear()
                    self.incoming.clear()

    async def iterate(self) -> None:
        """One iteration (admit, one prefill chunk, one batched step), under ``lock``: for
        a rank that follows another's iterations (smoe/engine/mirror.py)."""
        await self._iteration()

    def _gone(self, ticket: Ticket) -> bool:
        """Whether the batcher acts on the ticket's cancel now (module docstring)."""
        return self.coordinator.gone(ticket)

    async def _iteration(self) -> None:
        self._drop_cancelled()
        while self.waiting and len(self.active) < self.max_batch:
            ticket = self.waiting.popleft()
            if self._gone(ticket):
                continue
            if self.on_demand is not None:
                self.on_demand()
            try:
                ticket.seq = await self.compute.run(ticket.prepare)
            except Exception as e:
                ticket._finish(Failed(e))
                continue
            except BaseException:  # close() cancelled us: it ends the ticket with the rest
                self.waiting.appendleft(ticket)
                raise
            ticket.prompt_run = ticket.seq.to_prefill()
            self._settle(ticket)
            self.active.append(ticket)

        prefill = next_prefill(self.active)
        if prefill is not None:
            self._timeline("idle")  # a prefill chunk between steps is not the loop's time
            await self._prefill(prefill)
            self._settle(prefill)  # a prompt just done decodes in this same iteration
        ready = ready_to_decode(self.active)
        if ready:
            await self._decode(ready)
        else:
            self._timeline("idle")
        self._drop_cancelled()

    def _timeline(self, event: str) -> None:
        if self.timeline is not None:
            getattr(self.timeline, event)()

    @staticmethod
    def _update(ticket: Ticket) -> None:
        """PREFILLING while prompt tokens remain, then DECODING (FINISHED stays)."""
        if not ticket.finished:
            prefilling = ticket.seq.to_prefill() > 0
            ticket.state = RequestState.PREFILLING if prefilling else RequestState.DECODING

    def _settle(self, ticket: Ticket) -> None:
        """``_update``; a prompt just prefilled then hands over its log-probabilities, if
        asked (``Prompt``), and a ticket of no tokens (max_tokens 0) ends there."""
        self._update(ticket)
        if ticket.state is not RequestState.DECODING:
            return
        take = getattr(ticket.seq, "take_prompt_scores", None)  # (the runner's sequences)
        scores = take() if take is not None else None
        if scores is not None:
            ticket.events.put_nowait(Prompt(scores))
        if ticket.max_tokens <= 0:
            ticket._finish(End("length"))

    def _drop_cancelled(self) -> None:
        self.active = [t for t in self.active if not (self._gone(t) or t.finished)]
        while self.waiting and self._gone(self.waiting[0]):
            self.waiting.popleft()

    async def _prefill(self, ticket: Ticket) -> None:
        before = self.meter()
        try:
            await self.compute.run(self.runner.prefill_chunk, ticket.seq)
        except Exception as e:
            ticket._finish(Failed(e))
            return
        finally:
            cost = self.meter() - before
            ticket.prefill.add(cost)

    async def _decode(self, ready: list[Ticket]) -> None:
        before = self.meter()
        try:
            # ``more``: whether any row will be stepped again (a row ending at its length
            # needs no pass built ahead of it; see Runner.step).
            more = any(t.generated + 1 < t.max_tokens for t in ready)
            runs = await self._step(ready, more)
        except Exception as e:
            for t in ready:
                t._finish(Failed(e))
            return
        cost = self.meter() - before
        self.steps += 1
        self.step_rows += len(ready)
        for ticket, tokens in zip(ready, runs, strict=True):
            # The first token's step belongs to the time to first token, as in solo use.
            m = ticket.prefill if ticket.generated == 0 else ticket.decode
            m.add(cost, len(ready))
            if ticket.generated > 0:
                ticket.batch_sizes.append(len(ready))
            take = getattr(ticket.seq, "take_scores", None)  # (the runner's sequences)
            scores = take() if take is not None else []
            for i, token in enumerate(tokens):
                ticket.generated += 1
                ticket.events.put_nowait(Token(token, scores[i] if i < len(scores) else None))
                if token in ticket.eos:
                    ticket._finish(End("stop"))
                elif ticket.generated >= ticket.max_tokens:
                    ticket._finish(End("length"))
                if ticket.finished:
                    break

    async def _step(self, ready: list[Ticket], more: bool) -> list[list[int]]:
        """Each ready ticket's new tokens: a drafted step when one request decodes alone
        and drafting is on, else one batched step (one token each)."""
        if self.draft is not None and len(ready) == 1:
            t = ready[0]
            return [await self.compute.run(self.draft, t.seq, t.max_tokens - t.generated, t.eos)]
        self._timeline("next_step")
        try:
            tokens = await self.compute.run(self.runner.step_batch, [t.seq for t in ready], more)
        finally:
            self._timeline("returned")
        return [[token] for token in tokens]
