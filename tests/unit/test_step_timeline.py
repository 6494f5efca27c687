"""The per-step timeline (smoe.compute.timeline): what the runner and the batcher note per
decode step, and the summary's medians, with a controlled clock (no sleeps)."""

from __future__ import annotations

import pytest

from smoe.compute import timeline as timeline_mod
from smoe.compute.runner import Runner
from smoe.compute.timeline import StepTime, StepTimeline
from smoe.sampling import SamplingParams
from tests.exact.test_build_ahead import PROMPT, make_model


def test_the_summary_gives_medians_by_rows_and_periods_only_between_like_steps():
    t = StepTimeline()
    for start, rows in [(0.0, 1), (0.010, 1), (0.030, 1), (0.040, 4), (0.060, 4), (0.090, 4)]:
        t.add(StepTime(rows, start, build=0.001 * rows, queue=0.002, wait=0.0005))
    got = t.summary()["by_rows"]
    assert got["1"] == {
        "steps": 3,
        "build_ms": 1.0,
        "queue_ms": 2.0,
        "wait_ms": 0.5,
        "period_ms": 15.0,
    }
    # the 1 -> 4 step is no period of either: 20 and 30 ms between the 4-row steps
    assert got["4"]["period_ms"] == 25.0 and got["4"]["build_ms"] == 4.0
    assert t.summary()["loop_ms"] is None


def test_the_loop_gap_counts_only_from_a_return_to_the_next_step(monkeypatch):
    clock = iter([1.000, 1.003, 2.000, 5.000, 5.001])
    monkeypatch.setattr(timeline_mod.time, "perf_counter", lambda: next(clock))
    t = StepTimeline()
    t.next_step()  # nothing returned yet: no gap
    t.returned()  # 1.000
    t.next_step()  # 1.003: 3 ms
    t.returned()  # 2.000
    t.idle()  # a prefill chunk or an empty batch: this gap is not a step's
    t.next_step()
    t.returned()  # 5.000
    t.next_step()  # 5.001: 1 ms
    assert list(t.loop_gaps) == pytest.approx([0.003, 0.001])
    assert t.summary()["loop_ms"] == 2.0
    t.clear()
    assert not t.steps and not t.loop_gaps


def test_a_runner_notes_every_step_built_ahead_and_none_it_runs_plainly():
    model = make_model()
    ahead, plain = Runner(model, resident=lambda: True), Runner(model)
    for runner in (ahead, plain):
        seq = runner.start(PROMPT, SamplingParams())
        for i in range(6):
            runner.step(seq, more=i < 5)
    assert len(plain.timeline.steps) == 0
    steps = list(ahead.timeline.steps)
    assert [s.rows for s in steps] == [1] * 6
    assert all(s.build > 0 and s.queue > 0 and s.wait >= 0 for s in steps[:-1])
    assert steps[-1].queue == 0  # the last step (more=False) queues nothing ahead
    assert [s.start for s in steps] == sorted(s.start for s in steps)
    assert ahead.timeline.summary()["by_rows"]["1"]["steps"] == 6
