"""The scheduler's back-off from bets that do not pay (smoe/sched/governor.py): pure, and
through the scheduler with the test's own reads (no sleeps)."""

from __future__ import annotations

import pytest

from smoe.sched.governor import SpeculationGovernor


def test_bets_are_taken_until_a_window_of_outcomes_is_known():
    g = SpeculationGovernor(window=4, floor=0.5, probe=3)
    for used in (False, False, False):
        g.outcome(used)
        assert g.allows() and g.share is None


def test_mostly_wasted_bets_are_declined_but_for_a_probe_in_every_few():
    g = SpeculationGovernor(window=4, floor=0.5, probe=3)
    for used in (False, False, False, True):
        g.outcome(used)
    assert g.share == 0.25
    asked = [g.allows() for _ in range(9)]
    assert asked == [False, False, True] * 3  # one probe in every three asks


def test_bets_resume_once_they_pay_again():
    g = SpeculationGovernor(window=4, floor=0.5, probe=100)
    for used in (False,) * 4:
        g.outcome(used)
    assert not g.allows()
    for used in (True, True):  # the probes' bets were used
        g.outcome(used)
    assert g.share == 0.5 and g.allows()


@pytest.mark.parametrize(("window", "floor", "probe"), [(0, 0.5, 1), (4, 1.5, 1), (4, 0.5, 0)])
def test_bad_settings_are_refused(window, floor, probe):
    with pytest.raises(ValueError):
        SpeculationGovernor(window=window, floor=floor, probe=probe)
