"""Prefill on the compute thread: a prompt through a Runner's model in chunks.

The prompt is fed in chunks of ``runner.chunk`` tokens. With ``runner.layer_major`` (the
default where the architecture allows it) the chunks advance together one MoE layer at a
time (smoe.compute.prompt_pass), so each layer reads the union of the whole prompt's experts
once; otherwise each chunk runs every layer before the next starts, and each layer reads the
union of that chunk's experts. Every token's bits are the same either way. Each chunk's pass
is the runner's (``Runner.chunk_runner``); this module decides which chunks run, and when.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from smoe.compute.logprobs import TokenLogprob, chunk_logprobs
from smoe.compute.prompt_pass import CHUNK_HALF, PromptPass
from smoe.compute.sequence import Sequence_

if TYPE_CHECKING:  # the runner calls in here; its type is for the annotations only
    from smoe.compute.runner import Runner


def pieces(tokens: Sequence[int], chunk: int) -> list[list[int]]:
    """``tokens`` cut into chunks of ``chunk`` (the last may be shorter)."""
    return [list(tokens[i : i + chunk]) for i in range(0, len(tokens), chunk)]


def feed(runner: Runner, tokens: Sequence[int], cache: list[Any], logits: bool) -> mx.array | None:
    """Run ``tokens`` through the model in chunks; return logits [T, V] if asked."""
    run = runner.chunk_runner(cache, logits)
    out: list[Any] = []
    for start in range(0, len(tokens), runner.pass_tokens):
        part = tokens[start : start + runner.pass_tokens]
        if runner.layer_major:
            prompt = PromptPass(run, pieces(part, runner.chunk))
            while prompt.advance():
                pass
            out += prompt.results()
        else:
            out += [run(piece) for piece in pieces(part, runner.chunk)]
    return mx.concatenate(out, axis=0) if logits else None


def prefill_chunk(runner: Runner, seq: Sequence_) -> int:
    """Advance the prompt's prefill by one turn; return how many prompt tokens the
    turn worked on (0: the sequence is ready to sample). A turn is one chunk of up to
    ``chunk`` tokens through every layer, or, layer-major, the pass over up to
    ``pass_tokens`` tokens advanced by as many chunk units (a chunk up to its next MoE
    layer) as one chunk takes through every layer, plus any layer served on the way (the
    experts of every chunk at one layer, at once: the longest turn). Between turns nothing
    is pinned in the ring, so other sequences decode (the batcher alternates). A failed
    turn resets ``seq`` and raises."""
    todo = seq.to_prefill()
    if todo == 0:
        return 0
    try:
        scores = seq.prompt_scores  # the prompt's numbers, where asked (extended)
        if not runner.layer_major:
            piece = seq.tokens[seq.cached : seq.cached + min(todo, runner.chunk)]
            if scores is not None:
                scores += prompt_runner(runner, seq, seq.cached)(piece)
            else:
                feed(runner, piece, seq.cache, logits=False)
            seq.cached += len(piece)
            return len(piece)
        if seq.prompt is None:
            part = seq.tokens[seq.cached : seq.cached + min(todo, runner.pass_tokens)]
            run = (
                prompt_runner(runner, seq, seq.cached)
                if scores is not None
                else runner.chunk_runner(seq.cache, logits=False)
            )
            seq.prompt = PromptPass(run, pieces(part, runner.chunk))
        tokens = seq.prompt.tokens
        # a chunk's work through every layer: its start, then each layer's experts and
        # the attention after them (half a chunk-layer each)
        if not seq.prompt.advance(runner.layers + CHUNK_HALF):
            if scores is not None:
                scores += [e for r in seq.prompt.results() for e in r or ()]
            seq.prompt = None
            seq.cached += tokens
        return tokens
    except BaseException:
        runner.reset(seq)
        raise


def prompt_runner(runner: Runner, seq: Sequence_, start: int) -> Callable[[list[int]], Any]:
    """A chunk runner for a prefill from ``start`` that also scores the prompt: chunk i
    returns the entries of the tokens after its own (``chunk_logprobs``); chunks start
    in prompt order, so each knows where it stands."""
    run = runner.chunk_runner(seq.cache, logits=True)
    assert seq.params is not None and seq.params.prompt_logprobs is not None
    k, at = seq.params.prompt_logprobs, [start]

    def score(piece: list[int]) -> list[TokenLogprob]:
        first = at[0]
        at[0] += len(piece)
        targets = seq.tokens[first + 1 : first + 1 + len(piece)]
        return chunk_logprobs(run(piece), targets, k)

    return score
