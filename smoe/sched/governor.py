"""Whether speculative reads still pay (the scheduler's back-off).

A bet (a speculative load: the lookahead's, a gate echo's, a pre-warm's) ends one of two
ways: demand asks for its expert (used), or it is evicted without demand ever asking
(wasted: its bytes were read for nothing). ``SpeculationGovernor`` keeps the last
``window`` outcomes; while fewer than ``floor`` of them were used, the scheduler declines
new bets, but for every ``probe``-th, so that the share keeps being measured and bets
resume when they pay again. Under a small ring nearly every right guess is a miss it
saves; at half the model most right guesses are resident already and the wrong ones read
records nobody asks for (docs/performance.md, "Lookahead under a cap").

Event loop only (the scheduler's). Pure: no I/O, no MLX, no clock.
"""

from __future__ import annotations

from collections import deque


class SpeculationGovernor:
    """Recent bets' outcomes, and whether to take the next one."""

    def __init__(self, window: int = 64, floor: float = 0.5, probe: int = 8) -> None:
        if window < 1 or probe < 1 or not 0.0 <= floor <= 1.0:
            raise ValueError("window and probe must be at least 1, floor within [0, 1]")
        self.floor, self.probe = floor, probe
        self._outcomes: deque[bool] = deque(maxlen=window)
        self._declined_since_probe = 0

    def outcome(self, used: bool) -> None:
        """A bet ended: ``used`` by demand, or evicted unused."""
        self._outcomes.append(used)

    @property
    def share(self) -> float | None:
        """The used share of the last ``window`` outcomes; None until there are that many."""
        if len(self._outcomes) < (self._outcomes.maxlen or 0):
            return None
        return sum(self._outcomes) / len(self._outcomes)

    def allows(self) -> bool:
        """Whether to take a bet now."""
        share = self.share
        if share is None or share >= self.floor:
            self._declined_since_probe = 0
            return True
        self._declined_since_probe += 1
        if self._declined_since_probe >= self.probe:  # one probe in every ``probe`` asks
            self._declined_since_probe = 0
            return True
        return False
