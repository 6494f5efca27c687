"""How the next token is chosen: ``SamplingParams``, checked once, shared by the engine,
the compute thread and the servers. No MLX here: the surfaces import it without the
model code (the samplers themselves are mlx-lm's, built in smoe.compute.sampler)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability where it stands, and the ``k`` likeliest tokens there as
    (id, log-probability) pairs, likeliest first (``top``; empty for k = 0). Computed by
    smoe.compute.logprobs; carried by the engine's events."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


# The most alternatives a token's log-probability comes with (OpenAI's top_logprobs).
MAX_TOP_LOGPROBS = 20
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: a bias is in -100..100


@dataclass
class SamplingParams:
    """How the next token is chosen (mlx-lm's samplers; temperature 0 = greedy), and what
    is reported of the distributions it is chosen from.

    ``logprobs``: None, or report each generated token's log-probability with the
    ``logprobs`` likeliest alternatives (0..20). ``prompt_logprobs``: the same for every
    prompt token after the first, from the prefill (the sequence then starts from an empty
    cache). Both are the log-softmax of the model's logits in float32, before
    ``logit_bias`` and the penalties (vLLM's default, "raw" log-probabilities), and never
    change which tokens are drawn. ``logit_bias``: (token id, bias) pairs added to the
    logits before sampling (mlx-lm's logit_bias processor; a dict is taken too).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context: int = 20
    seed: int | None = None
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from seen tokens' logits
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        # (pairs, a dict, or lists of two after a trip through JSON: smoe.engine.mirror)
        self.logit_bias = bias_pairs(self.logit_bias)

    def check(self) -> None:
        import math

        from smoe.errors import SmoeError

        numbers = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }
        for name, value in numbers.items():  # NaN passes every comparison below
            if not math.isfinite(value):
                raise SmoeError(f"{name} must be a finite number, not {value}")
        if self.temperature < 0:
            raise SmoeError("temperature must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise SmoeError("top_p must be in (0, 1]")
        if self.top_k < 0 or not 0 <= self.min_p < 1:
            raise SmoeError("top_k must be >= 0 and min_p in [0, 1)")
        if self.repetition_penalty <= 0:
            raise SmoeError("repetition_penalty must be > 0 (1 is off)")
        if not (-2 <= self.presence_penalty <= 2 and -2 <= self.frequency_penalty <= 2):
            raise SmoeError("presence_penalty and frequency_penalty must be in [-2, 2]")
        for name, k in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
                raise SmoeError(f"{name} must be None or 0..{MAX_TOP_LOGPROBS} alternatives")
        for token, bias in self.logit_bias:
            if token < 0 or not math.isfinite(bias) or abs(bias) > LOGIT_BIAS_RANGE:
                raise SmoeError(
                    f"logit_bias maps token ids (>= 0) to biases in -100..100, not "
                    f"{token} -> {bias}"
                )


def bias_pairs(bias: Any) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (token id, bias) pairs, from a dict or pairs."""
    items: Iterable[Any] = bias.items() if isinstance(bias, dict) else (bias or ())
    return tuple(sorted((int(t), float(b)) for t, b in items))
