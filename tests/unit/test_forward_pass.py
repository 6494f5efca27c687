"""A forward pass's state (smoe.compute.tracing.forward_pass): the layers inside one pass
share it, nothing of it outlives the pass, and passes on other threads never see it."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest

from smoe.compute.tracing import Tracer, current_pass, forward_pass


def test_the_layers_inside_a_pass_share_its_state() -> None:
    with forward_pass(1) as state:
        assert current_pass() is state and state.phase == 1
        current_pass().gates[3] = mx.zeros((1, 4))
        assert 3 in state.gates


def test_outside_a_pass_each_call_gets_a_fresh_prefill_state() -> None:
    a, b = current_pass(), current_pass()
    assert a is not b and a.phase == 0
    a.deferred.append((0, mx.zeros((1, 2), mx.int32), None))
    assert not current_pass().deferred  # nothing done outside a pass is kept


def _failing_pass() -> None:
    with forward_pass(1) as state:
        state.deferred.append((0, mx.zeros((1, 2), mx.int32), None))
        state.predicted[1] = {5}
        raise RuntimeError("a read failed")


def test_a_failed_pass_leaves_nothing_to_the_next() -> None:
    with pytest.raises(RuntimeError):
        _failing_pass()
    with forward_pass(1) as nxt:
        assert not nxt.deferred and not nxt.predicted and not nxt.gates


def test_a_nested_pass_restores_the_outer_one() -> None:
    with forward_pass(0) as outer:
        with forward_pass(1) as inner:
            assert current_pass() is inner
        assert current_pass() is outer


def test_passes_on_two_threads_do_not_share_state() -> None:
    # Forced order: the other thread opens its pass while ours is open, and checks it
    # sees its own; then ours checks it still sees its own.
    opened, checked = threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def other() -> None:
        opened.wait()
        with forward_pass(0) as mine:
            seen["other"] = current_pass() is mine and mine.phase == 0
        checked.set()

    t = threading.Thread(target=other)
    t.start()
    with forward_pass(1) as ours:
        opened.set()
        checked.wait()
        seen["ours"] = current_pass() is ours
    t.join()
    assert seen == {"other": True, "ours": True}


def test_take_empties_the_state_and_count_adds_it_once() -> None:
    class Source:
        def __init__(self) -> None:
            self.resident = 0

        def count_resident(self, n: int) -> None:
            self.resident += n

    tracer, source = Tracer(num_experts=8), Source()
    with forward_pass(1) as state:
        state.deferred.append((2, mx.array([[1, 3], [3, 5]], mx.int32), source))
        routing = tracer.take(state)
    assert not state.deferred and tracer.take(state) is None
    tracer.count(routing)
    assert source.resident == 3 and tracer.counters.unique_experts == 3
    assert [(c.layer, c.tokens) for c in tracer.counters.calls] == [(2, 2)]
