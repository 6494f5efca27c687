"""One generation's state on the compute thread (``Sequence_``), which smoe.compute.runner's
passes read and advance: its KV cache, its token stream, its sampler, and the decode pass
built one step ahead, if any."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from smoe.compute.logprobs import TokenLogprob
from smoe.compute.prompt_pass import PromptPass
from smoe.sampling import SamplingParams


@dataclass
class Sequence_:
    """One generation's state on the compute thread: KV cache, tokens, sampler."""

    cache: list[Any]
    tokens: list[int] = field(default_factory=list)  # the stream: prompt(s) and replies
    cached: int = 0  # leading tokens whose keys/values are in ``cache``
    sampler: Callable[[mx.array], mx.array] | None = None
    processors: list[Callable[[mx.array, mx.array], mx.array]] = field(default_factory=list)
    seed: int | None = None  # seeded sampling: each position's draw depends on it alone
    # Decode built one step ahead (Runner.step on a resident model): the next token, not
    # yet evaluated, whose pass has already put ``tokens[-1]``'s keys/values in ``cache``,
    # and that pass's deferred routing, counted once it is evaluated.
    ahead: mx.array | None = None
    ahead_routing: Any = None  # a DeferredRouting, or None
    ahead_pass: BatchPass | None = None  # the batched pass ``ahead`` is a row of, if any
    params: SamplingParams | None = None  # set by Runner.prepare (drafting reads it)
    governor: Any = None  # a DraftGovernor once Runner.step_draft has run on it
    # A layer-major prefill under way (Runner.prefill_chunk): its chunks suspended at a
    # MoE layer; ``cached`` counts its tokens only once it is done.
    prompt: PromptPass | None = None
    bias: Callable[[Any, mx.array], mx.array] | None = None  # logit_bias (mlx-lm's processor)
    # Log-probabilities (params.logprobs, params.prompt_logprobs; smoe.compute.logprobs):
    # the log-softmax row beside ``ahead``, each appended token's entry until taken, and
    # the prompt's (None: not asked) as the prefill computes them.
    ahead_row: mx.array | None = None
    scores: list[TokenLogprob] = field(default_factory=list)
    prompt_scores: list[TokenLogprob] | None = None

    def take_scores(self) -> list[TokenLogprob]:
        """The entries of the tokens appended since the last take (none unless asked)."""
        scores, self.scores = self.scores, []
        return scores

    def take_prompt_scores(self) -> list[TokenLogprob] | None:
        """The prompt's entries once its prefill is done (None: not asked or not done)."""
        if self.prompt_scores is None or self.to_prefill() > 0 or self.prompt is not None:
            return None
        scores, self.prompt_scores = self.prompt_scores, None
        return scores

    def to_prefill(self) -> int:
        """Prompt tokens still to run before the sequence can be sampled."""
        return max(0, len(self.tokens) - 1 - self.cached)

    def kv_bytes(self) -> int:
        """Bytes its KV cache holds (allocated)."""
        return sum(int(getattr(c, "nbytes", 0)) for c in self.cache)

    def forget_ahead(self) -> None:
        """Drop the fields of a pass built ahead (its token, routing, batch and row): the
        pass was taken, or its keys/values left the cache (``Runner.settle``)."""
        self.ahead, self.ahead_routing, self.ahead_pass, self.ahead_row = None, None, None, None


@dataclass(eq=False)
class BatchPass:
    """A batched decode pass built ahead (Runner.step_batch): each row's next token, and
    the pass's routing, counted when its tokens are first read (None once counted)."""

    tokens: mx.array  # [B] lazy
    routing: Any = None


def cache_nbytes(seq: Sequence_) -> int:
    """Bytes ``seq``'s KV cache holds (its allocated capacity, quantized or not)."""
    return sum(int(getattr(c, "nbytes", 0)) for c in seq.cache)
