"""How a sequence's next token is drawn on the compute thread: mlx-lm's sampler, logit
processors and logit bias, built from its SamplingParams (``configure``), applied in
mlx-lm's order (``processed``), and the draw itself, seeded per position (``draw``)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from smoe.compute.sequence import Sequence_
from smoe.sampling import SamplingParams


def configure(seq: Sequence_, params: SamplingParams) -> None:
    """Give ``seq`` the logit bias, sampler and processors ``params`` ask for."""
    seq.bias = make_logits_processors(dict(params.logit_bias))[0] if params.logit_bias else None
    seq.sampler = make_sampler(
        params.temperature, params.top_p, params.min_p, 1, top_k=params.top_k
    )
    seq.processors = make_logits_processors(
        None,
        params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        params.repetition_context,
        params.presence_penalty or None,
        params.repetition_context,
        params.frequency_penalty or None,
        params.repetition_context,
    )


def processed(seq: Sequence_, logits: mx.array) -> mx.array:
    """``logits`` [1, V] after ``seq``'s logit bias, then its processors (they read
    ``seq.tokens``): the order of mlx-lm's make_logits_processors."""
    if seq.bias is not None:
        logits = seq.bias(None, logits)
    if seq.processors:
        history = mx.array(seq.tokens)
        for p in seq.processors:
            logits = p(history, logits)
    return logits


def draw(seq: Sequence_, logits: mx.array, position: int) -> mx.array:
    """The token [1] (lazy) drawn from ``logits`` [1, V] for ``seq.tokens[position]``
    with ``seq``'s logit bias, processors and sampler."""
    logits = processed(seq, logits)
    assert seq.sampler is not None
    if seq.seed is not None:  # a draw per position, whatever else shares the step
        mx.random.seed((seq.seed * 1_000_003 + position) % 2**64)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    token: mx.array = seq.sampler(logprobs)
    return token
