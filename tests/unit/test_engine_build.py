"""The engine's parts opened on one exit stack (smoe/engine/build.py): the order they
close in, normally and after a failure halfway, through spies on each part's close."""

from __future__ import annotations

import pytest

import smoe.engine.build as build
from smoe.compute.worker import ComputeThread
from smoe.engine import Engine
from smoe.engine.batcher import Batcher
from smoe.io.reader import RecordReader
from smoe.io.staged import StagedRing
from smoe.sched.popularity import Popularity
from smoe.sched.scheduler import ExpertScheduler
from tests.conftest import tiny_vault


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    return tiny_vault(tmp_path_factory.mktemp("build"), seed=3)


@pytest.fixture
def closes(monkeypatch):
    """The parts' closes, in the order they happen (the first of each kind)."""
    seen: list[str] = []

    def spy(cls, name, label):
        inner = getattr(cls, name)
        if name == "close" and cls in (ComputeThread, Batcher, ExpertScheduler):

            async def spied(self, *a, **k):
                seen.append(label)
                return await inner(self, *a, **k)
        else:

            def spied(self, *a, **k):
                seen.append(label)
                return inner(self, *a, **k)

        monkeypatch.setattr(cls, name, spied)

    spy(ComputeThread, "close", "compute")
    spy(Batcher, "close", "batcher")
    spy(ExpertScheduler, "close", "scheduler")
    spy(StagedRing, "close", "ring")
    spy(RecordReader, "close", "reader")
    spy(Popularity, "save", "popularity")
    return lambda: list(dict.fromkeys(seen))


@pytest.mark.asyncio
async def test_parts_close_in_order(vault, closes):
    """No new step, then the compute thread (the step in progress and queued commits),
    then the ring (a read waiting for a landing buffer gives up), the scheduler, the
    reader's threads, and the counts saved once nothing counts into them."""
    async with Engine.open(vault, slots=4, ring="staged") as engine:
        assert [e.text async for e in engine.generate([1, 2, 3], max_tokens=2)]
        assert closes() == []
    assert closes() == ["batcher", "compute", "ring", "scheduler", "reader", "popularity"]
    assert not engine.is_open and engine.debug.runner is None
    await engine.aclose()  # idempotent
    with pytest.raises(Exception, match="not open"):
        engine.debug.parts()


@pytest.mark.asyncio
async def test_a_failure_halfway_closes_what_started(vault, closes, monkeypatch):
    """The tokenizer failing to load (after the ring, reader, scheduler and model) closes
    exactly those, in the same order, and the error reaches the caller."""

    def broken(vault):
        raise OSError("tokenizer unreadable")

    monkeypatch.setattr(build, "_load_tokenizer", broken)
    with pytest.raises(OSError, match="tokenizer unreadable"):
        async with Engine.open(vault, slots=4, ring="staged"):
            pass
    assert closes() == ["compute", "ring", "scheduler", "reader", "popularity"]
