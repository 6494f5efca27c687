"""Forward passes on the compute thread: chunked layer-major prefill and decode steps.

Prefill feeds the prompt in chunks of ``chunk`` tokens; within a chunk the model runs layer
by layer, so each MoE layer sees the whole chunk's routing at once and reads the union of
its experts once. The LM head is evaluated only where a token is sampled: the prompt's last
token is run on its own, as mlx-lm's generate does, and earlier chunks' logits are never
evaluated (MLX is lazy, so they are never computed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache


@dataclass
class SamplingParams:
    """How the next token is chosen (mlx-lm's samplers; temperature 0 = greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context: int = 20
    seed: int | None = None

    def check(self) -> None:
        from smoe.errors import SmoeError

        if self.temperature < 0:
            raise SmoeError("temperature must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise SmoeError("top_p must be in (0, 1]")
        if self.top_k < 0 or not 0 <= self.min_p < 1:
            raise SmoeError("top_k must be >= 0 and min_p in [0, 1)")
        if self.repetition_penalty <= 0:
            raise SmoeError("repetition_penalty must be > 0 (1 is off)")


@dataclass
class Sequence_:
    """One generation's state on the compute thread: KV cache, tokens, sampler."""

    cache: list[Any]
    tokens: list[int] = field(default_factory=list)
    sampler: Callable[[mx.array], mx.array] | None = None
    processors: list[Callable[[mx.array, mx.array], mx.array]] = field(default_factory=list)


class Runner:
    """Runs ``model`` (with streamed experts) on the compute thread."""

    def __init__(self, model: Any, chunk: int = 64) -> None:
        self.model = model
        self.chunk = chunk

    def new_cache(self) -> list[Any]:
        return make_prompt_cache(self.model)

    def _feed(self, tokens: Sequence[int], cache: list[Any], logits: bool) -> mx.array | None:
        """Run ``tokens`` through the model in chunks; return logits [T, V] if asked."""
        out = []
        for start in range(0, len(tokens), self.chunk):
            piece = mx.array(tokens[start : start + self.chunk])[None]
            y = self.model(piece, cache=cache)
            if logits:
                mx.eval(y)
                out.append(y[0])
            else:
                mx.eval([c.state for c in cache])  # the layers, not the LM head
        return mx.concatenate(out, axis=0) if logits else None

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits [T, vocab] as float32 numpy, on a fresh cache."""
        cache = self.new_cache()
        y = self._feed(tokens, cache, logits=True)
        assert y is not None
        return np.array(y.astype(mx.float32))

    def start(self, prompt: Sequence[int], params: SamplingParams) -> Sequence_:
        """Prefill all but the prompt's last token (their logits are never computed)."""
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        if params.seed is not None:
            mx.random.seed(params.seed)
        seq = Sequence_(
            cache=self.new_cache(),
            tokens=list(prompt),
            sampler=make_sampler(
                params.temperature, params.top_p, params.min_p, 1, top_k=params.top_k
            ),
            processors=make_logits_processors(
                None, params.repetition_penalty, params.repetition_context
            )
            if params.repetition_penalty != 1.0
            else [],
        )
        self._feed(prompt[:-1], seq.cache, logits=False)
        return seq

    def step(self, seq: Sequence_) -> int:
        """Run the last token, sample the next one, append it; return it."""
        y = self.model(mx.array(seq.tokens[-1:])[None], cache=seq.cache)
        logits = y[:, -1, :]
        if seq.processors:
            history = mx.array(seq.tokens)
            for p in seq.processors:
                logits = p(history, logits)
        assert seq.sampler is not None
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = int(seq.sampler(logprobs).item())
        seq.tokens.append(token)
        return token
