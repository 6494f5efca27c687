"""Lossless prompt-lookup drafting (``--draft ngram``): guess the next tokens from the
sequence itself, verify them in one pass, keep what the model would have produced anyway.

Not the expert *speculation* of docs/speculation.md (reads queued before the router asks
for them): this guesses *tokens*. Its gain for S-MoE: verifying k drafted tokens is one
layer-major pass over k+1 tokens, so each MoE layer reads the union of their experts once
where plain decode reads each token's experts in its own pass (docs/draft.md).

- ``NgramDrafter``: the model-free n-gram lookup (transformers' ``prompt_lookup_num_tokens``,
  vLLM's ``ngram``): match the last n tokens, n from ``max_n`` down to ``min_n``, against the
  sequence's earlier tokens; propose the (up to) k tokens that followed the latest match.
- ``accept_sampled``: the exact acceptance rule for a deterministic drafter (q = one-hot):
  accept x with probability p(x), else draw from p with x removed, renormalised; the token
  that comes out is distributed exactly as p.
- ``target_probs``: p, the distribution plain decoding samples from (mlx-lm's filters, in
  its sampler's order, then softmax of logprobs / temperature).
- ``DraftGovernor``: per sequence, measures a verify pass against a plain step and switches
  drafting off while it does not pay (retrying after a backoff).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DRAFTERS = ("ngram",)
MAX_DRAFT_TOKENS = 32  # a verify pass runs k + 1 tokens: a prefill chunk's work at most


class NgramDrafter:
    """Prompt lookup: the continuation of the latest earlier occurrence of the sequence's
    last n tokens (n from ``max_n`` down to ``min_n``). Pure numpy; no model."""

    def __init__(self, max_n: int = 4, min_n: int = 2) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier match of the longest
        matching suffix of ``tokens``; [] when no suffix of at least ``min_n`` recurs."""
        if k < 1 or len(tokens) <= self.min_n:
            return []
        t = np.asarray(tokens, dtype=np.int64)
        size = len(t)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            # windows [i, i+n) for i < size - n: each has at least one token after it
            windows = np.lib.stride_tricks.sliding_window_view(t[:-1], n)  # [size-n, n]
            hits = np.flatnonzero((windows == t[size - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest match: most recent context
                proposal: list[int] = t[start : start + k].tolist()
                return proposal
        return []


def accept_sampled(draft: int, p: np.ndarray, rng: np.random.Generator) -> tuple[bool, int]:
    """The exact acceptance rule for a drafted token ``draft`` proposed with certainty:
    accept it with probability p[draft]; else return a token drawn from p with ``draft``
    removed and the rest renormalised. The token returned is distributed as p.

    p: [V] float64 probabilities summing to 1 (``target_probs``)."""
    if rng.random() < p[draft]:
        return True, draft
    rest = p.copy()
    rest[draft] = 0.0
    total = rest.sum()
    if total <= 0:  # p[draft] == 1 up to rounding: the draw above accepts it
        return True, draft
    return False, int(rng.choice(len(rest), p=rest / total))


def target_probs(logprobs: Any, params: Any) -> np.ndarray:
    """p [V] float64: the distribution mlx-lm's sampler (``make_sampler`` with ``params``'
    temperature, top_p, min_p, top_k) draws from, given ``logprobs`` [1, V] (an mx.array,
    after the logits processors). Its filters in its order, then softmax(logprobs / temp)."""
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p != 0.0:
        logprobs = apply_min_p(logprobs, params.min_p, 1)
    if params.top_k > 0:
        logprobs = apply_top_k(logprobs, params.top_k)
    scaled = np.array((logprobs * (1.0 / params.temperature)).astype(mx.float32))[0]
    scaled = scaled.astype(np.float64)
    e = np.exp(scaled - scaled.max())
    p: np.ndarray = e / e.sum()
    return p


def seeded_rng(seed: int | None, position: int) -> np.random.Generator | None:
    """A seeded request's generator for ``position`` (its draws depend on nothing else,
    as plain seeded decoding's); None when the request is not seeded."""
    if seed is None:
        return None
    return np.random.default_rng((seed * 1_000_003 + position) % 2**64)


@dataclass
class DraftStats:
    """Engine-wide counters of drafting (benchmarks and ``smoe generate --json``)."""

    verify_passes: int = 0
    drafted: int = 0  # tokens proposed and verified
    accepted: int = 0  # of them, tokens the model kept
    plain_steps: int = 0  # decode steps without a draft (none found, off, or probing)
    switch_offs: int = 0  # times a sequence's governor turned drafting off

    def to_json(self) -> dict[str, Any]:
        return {
            "verify_passes": self.verify_passes,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
            "plain_steps": self.plain_steps,
            "switch_offs": self.switch_offs,
        }


@dataclass
class DraftGovernor:
    """One sequence's on-line judgement of whether drafting pays.

    It keeps moving averages of a plain step's seconds, a verify pass's seconds and the
    tokens a verify pass yields (accepted drafts + the model's own token). After
    ``min_passes`` verify passes, drafting pays while tokens/second with drafts exceed
    1/plain-step seconds; when it does not, the sequence decodes plainly for ``backoff``
    steps (doubling each time, up to ``max_backoff``), then tries again from scratch. Every
    ``probe_every`` verify passes one plain step refreshes the plain figure.
    """

    min_passes: int = 4
    probe_every: int = 16
    backoff: int = 32
    max_backoff: int = 1024
    alpha: float = 0.25  # weight of the newest measurement in each average
    step_s: float | None = None
    verify_s: float | None = None
    gain: float | None = None  # tokens per verify pass
    passes: int = 0  # verify passes since drafting was (re)started
    since_plain: int = 0  # verify passes since the last plain step
    off_for: int = 0  # plain steps left before drafting is tried again
    switch_offs: int = 0

    def wants_draft(self) -> bool:
        """Whether the next step should verify a draft (if the drafter has one)."""
        if self.off_for > 0:
            return False
        # A probe: the plain figure is missing or stale.
        due = self.step_s is None and self.passes >= self.min_passes
        return not (due or self.since_plain >= self.probe_every)

    @property
    def drafting(self) -> bool:
        """False while switched off (backing off)."""
        return self.off_for == 0

    def plain(self, seconds: float) -> None:
        """A plain step took ``seconds``."""
        self.step_s = self._avg(self.step_s, seconds)
        self.since_plain = 0
        if self.off_for > 0:
            self.off_for -= 1
            if self.off_for == 0:  # try again, judged afresh
                self.passes, self.verify_s, self.gain = 0, None, None

    def verified(self, seconds: float, tokens: int) -> None:
        """A verify pass took ``seconds`` and yielded ``tokens`` tokens."""
        self.verify_s = self._avg(self.verify_s, seconds)
        self.gain = self._avg(self.gain, float(tokens))
        self.passes += 1
        self.since_plain += 1
        if self.pays() is False:
            self.off_for = self.backoff
            self.backoff = min(2 * self.backoff, self.max_backoff)
            self.switch_offs += 1

    def pays(self) -> bool | None:
        """Whether drafting beats plain decode in tokens per second; None: not known yet."""
        if self.passes < self.min_passes or self.step_s is None:
            return None
        assert self.verify_s is not None and self.gain is not None
        return self.gain * self.step_s > self.verify_s

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new


@dataclass
class Drafting:
    """What a Runner drafts with: the drafter, k (``tokens``), a governor per sequence
    (``governor()``), the clock the governors are fed from, the generator of unseeded
    requests' acceptance draws, and the engine's counters."""

    drafter: NgramDrafter = field(default_factory=NgramDrafter)
    tokens: int = 4
    governor: Callable[[], DraftGovernor] = DraftGovernor
    clock: Callable[[], float] = time.perf_counter
    rng: np.random.Generator = field(default_factory=np.random.default_rng)  # unseeded draws
    stats: DraftStats = field(default_factory=DraftStats)

    @classmethod
    def named(cls, name: str, tokens: int) -> Drafting:
        """The drafting ``--draft NAME --draft-tokens K`` asks for (names: DRAFTERS)."""
        assert name in DRAFTERS and tokens >= 1  # EngineOptions.check refused the rest
        return cls(NgramDrafter(), tokens)
