"""The batcher's scheduling, driven deterministically: a fake runner that logs each job and
a compute thread whose jobs the test releases one by one (no model, no sleeps)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from smoe.engine.batcher import Batcher, End, Failed, Meter, RequestState, Ticket, Token
from smoe.errors import SmoeError

pytestmark = pytest.mark.asyncio


@dataclass
class FakeSeq:
    name: str
    prompt_left: int  # tokens to prefill
    tokens: list[int] = field(default_factory=list)

    def to_prefill(self) -> int:
        return self.prompt_left


class FakeRunner:
    """Prefill chunks of 2 tokens; a decode step gives each row 100 + its step count."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.fail_step: Exception | None = None

    def prefill_chunk(self, seq: FakeSeq) -> int:
        n = min(2, seq.prompt_left)
        seq.prompt_left -= n
        self.log.append(f"prefill {seq.name}")
        return n

    def step_batch(self, seqs: list[FakeSeq], more: bool = True) -> list[int]:
        self.log.append("step " + ",".join(s.name for s in seqs) + ("" if more else " last"))
        if self.fail_step is not None:
            raise self.fail_step
        for s in seqs:
            s.tokens.append(100 + len(s.tokens))
        return [s.tokens[-1] for s in seqs]


class GatedCompute:
    """Runs each job when the test says so (``gated``), else at once."""

    def __init__(self) -> None:
        self.gated = False
        self.started: asyncio.Queue[asyncio.Event] = asyncio.Queue()

    async def run(self, fn, *args):
        if self.gated:
            go = asyncio.Event()
            await self.started.put(go)
            await go.wait()
        return fn(*args)

    async def release(self) -> None:
        (await self.started.get()).set()


def make(max_batch: int = 8) -> tuple[Batcher, FakeRunner, GatedCompute, list[str]]:
    runner, compute, events = FakeRunner(), GatedCompute(), []
    batcher = Batcher(
        compute,
        runner,
        asyncio.Lock(),
        Meter,
        max_batch=max_batch,
        on_demand=lambda: events.append("demand"),
        on_idle=lambda: events.append("idle"),
    )
    return batcher, runner, compute, events


def ticket(name: str, prompt_left: int, max_tokens: int, eos=frozenset()) -> Ticket:
    seq = FakeSeq(name, prompt_left)
    return Ticket(lambda: seq, max_tokens, eos)


def as_pair(event: object) -> tuple[str, object]:
    """A ticket's typed event as (kind, value), for compact assertions."""
    if isinstance(event, Token):
        return "token", event.id
    if isinstance(event, End):
        return "end", event.reason
    assert isinstance(event, Failed), event
    return "error", event.error


async def drain(t: Ticket) -> list[tuple[str, object]]:
    out = []
    while True:
        out.append(as_pair(await t.events.get()))
        if out[-1][0] in ("end", "error"):
            return out


async def test_prefill_interleaves_with_decode_and_rows_share_steps():
    batcher, runner, _, _ = make()
    a = batcher.submit(ticket("a", 3, 3))  # two chunks of prefill
    b = batcher.submit(ticket("b", 1, 2))  # one chunk
    got_a, got_b = await asyncio.gather(drain(a), drain(b))
    assert runner.log == [
        "prefill a",  # iteration 1: the oldest prefilling request, one chunk
        "prefill a",  # 2: a is done; b still waits for its chunk ...
        "step a",  # ... but a decodes meanwhile
        "prefill b",  # 3
        "step a,b",  # b joins the batch
        "step a,b last",  # 4: a ends (3 tokens), b (2): nothing is built ahead
    ]
    assert got_a == [("token", 100), ("token", 101), ("token", 102), ("end", "length")]
    assert got_b == [("token", 100), ("token", 101), ("end", "length")]
    assert (batcher.steps, batcher.step_rows) == (3, 5)
    assert a.batch_sizes == [2, 2] and b.batch_sizes == [2]  # the first token's step: TTFT


async def test_max_batch_holds_back_the_rest_until_a_place_frees():
    batcher, runner, _, events = make(max_batch=2)
    tickets = [batcher.submit(ticket(n, 0, m)) for n, m in (("a", 1), ("b", 3), ("c", 1))]
    assert batcher.queued == 3
    await asyncio.gather(*(drain(t) for t in tickets))
    assert runner.log == ["step a,b", "step b,c", "step b last"]
    assert events.count("demand") == 3
    await batcher.wait_idle()
    assert events[-1] == "idle"


async def test_eos_ends_a_request_and_the_others_go_on():
    batcher, runner, _, _ = make()
    a = batcher.submit(ticket("a", 0, 5, eos=frozenset({101})))
    b = batcher.submit(ticket("b", 0, 3))
    got_a, got_b = await asyncio.gather(drain(a), drain(b))
    assert got_a[-1] == ("end", "stop") and len(got_a) == 3  # 100, 101 (eos), end
    assert runner.log == ["step a,b", "step a,b", "step b last"]


async def test_a_ticket_cancelled_during_its_step_leaves_at_the_next_iteration():
    batcher, runner, compute, _ = make()
    compute.gated = True
    a = batcher.submit(ticket("a", 0, 10))
    b = batcher.submit(ticket("b", 0, 3))
    await compute.release()  # prepare a
    await compute.release()  # prepare b
    await compute.release()  # step 1
    await compute.release()  # step 2 is under way ...
    a.cancel()  # ... and still computes a's row (a pass cannot be interrupted)
    compute.gated = False
    assert [kind for kind, _ in await drain(b)] == ["token"] * 3 + ["end"]
    assert runner.log == ["step a,b", "step a,b", "step b last"]  # a left after step 2
    await batcher.wait_idle()
    assert not batcher.active and a.events.qsize() == 2  # its two tokens, no more


async def test_a_failed_step_fails_its_rows_only_then_serving_goes_on():
    batcher, runner, _, _ = make()
    runner.fail_step = OSError("read error on expert 3")
    a, b = batcher.submit(ticket("a", 0, 2)), batcher.submit(ticket("b", 0, 2))
    for t in (a, b):
        kind, err = (await drain(t))[-1]
        assert kind == "error" and isinstance(err, OSError)
    runner.fail_step = None
    c = batcher.submit(ticket("c", 0, 1))
    assert (await drain(c))[-1] == ("end", "length")


async def test_a_failed_prepare_fails_that_request_alone():
    batcher, runner, _, _ = make()

    def bad():
        raise SmoeError("bad prompt")

    a = batcher.submit(Ticket(bad, 2))
    b = batcher.submit(ticket("b", 0, 1))
    assert (await drain(a))[-1][0] == "error"
    assert (await drain(b))[-1] == ("end", "length")


async def test_close_fails_what_is_left():
    batcher, runner, compute, _ = make()
    compute.gated = True
    a = batcher.submit(ticket("a", 0, 5))
    await compute.release()  # prepare a; its first step now waits
    await compute.started.get()
    await batcher.close()
    kind, err = (await drain(a))[-1]
    assert kind == "error" and "closed" in str(err)
    with pytest.raises(SmoeError):
        batcher.submit(ticket("b", 0, 1))


async def test_close_while_a_ticket_is_being_prepared_fails_it_too():
    """A ticket taken from the queue whose prepare is on the compute thread when the server
    stops was in neither list: close() never ended it, and its stream hung until the
    server's shutdown timeout cut it with no end event (found by the signal fuzzer)."""
    batcher, runner, compute, _ = make()
    compute.gated = True
    a = batcher.submit(ticket("a", 0, 5))
    await compute.started.get()  # a's prepare is running; nothing releases it
    await batcher.close(SmoeError("shutting down"))
    async with asyncio.timeout(30):  # (a guard: before the fix this waited forever)
        kind, err = (await drain(a))[-1]
    assert kind == "error" and "shutting down" in str(err)
    assert not batcher.waiting and not batcher.active


async def test_shared_step_bytes_are_split_among_rows():
    counter = {"bytes": 0}

    def meter() -> Meter:
        return Meter(bytes_read=counter["bytes"])

    class Reads(FakeRunner):
        def step_batch(self, seqs, more=True):
            counter["bytes"] += 900  # one read served all rows
            return super().step_batch(seqs, more)

    batcher = Batcher(GatedCompute(), Reads(), asyncio.Lock(), meter)
    ts = [batcher.submit(ticket(n, 0, 2)) for n in "abc"]
    await asyncio.gather(*(drain(t) for t in ts))
    for t in ts:  # step 1 counts for the time to first token, step 2 for decode
        assert t.prefill.bytes_read == 300 and t.decode.bytes_read == 300


async def test_a_failing_on_idle_does_not_stop_the_batcher():
    runner, compute = FakeRunner(), GatedCompute()

    def broken() -> None:
        raise RuntimeError("prewarm failed")

    batcher = Batcher(compute, runner, asyncio.Lock(), Meter, on_idle=broken)
    assert (await drain(batcher.submit(ticket("a", 0, 1))))[-1] == ("end", "length")
    await batcher.wait_idle()  # on_idle has raised by now
    assert (await drain(batcher.submit(ticket("b", 0, 1))))[-1] == ("end", "length")


async def test_the_plan_is_a_pure_function_of_the_states():  # (the module is async)
    from smoe.engine.batcher import next_prefill, ready_to_decode

    tickets = [ticket(n, 0, 1) for n in "abcd"]
    states = [
        RequestState.DECODING,
        RequestState.PREFILLING,
        RequestState.PREFILLING,
        RequestState.FINISHED,
    ]
    for t, state in zip(tickets, states, strict=True):
        t.state = state
    assert next_prefill(tickets) is tickets[1]  # the oldest prefilling one, alone
    assert ready_to_decode(tickets) == [tickets[0]]
    assert next_prefill([tickets[0], tickets[3]]) is None


async def test_a_ticket_moves_waiting_prefilling_decoding_finished():
    batcher, runner, compute, _ = make()
    t = ticket("a", 2, 2)  # two chunks of prompt, then two tokens
    seen: list[RequestState] = []
    run = compute.run

    async def noting(fn, *args):  # the ticket's state as each compute job starts
        seen.append(t.state)
        return await run(fn, *args)

    compute.run = noting
    batcher.submit(t)
    assert await drain(t) == [
        ("token", 100),
        ("token", 101),
        ("end", "length"),
    ]
    seen.append(t.state)
    states = [s for i, s in enumerate(seen) if i == 0 or s is not seen[i - 1]]
    assert states == [
        RequestState.WAITING,  # its prepare
        RequestState.PREFILLING,  # two chunks
        RequestState.DECODING,  # two steps
        RequestState.FINISHED,
    ]
