"""The verified prompt-lookup draft step (``Runner.step_draft``, ``Runner.verify``): a decode
step that runs the last token and up to k drafted ones in one pass (each MoE layer reads the
union of their experts once) and keeps the longest prefix plain decoding would have given.

The drafter, the acceptance rule and the governor are smoe.compute.draft's; this module runs
them on a Runner's passes. Greedy: the tokens plain steps give; sampling: their distribution.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from smoe.compute.draft import Drafting, accept_sampled, seeded_rng, target_probs
from smoe.compute.logprobs import note_scores, scored_row
from smoe.compute.rowwise import RowSequence
from smoe.compute.sampler import draw, processed
from smoe.compute.sequence import Sequence_
from smoe.util.tokens import common_prefix

if TYPE_CHECKING:  # the runner calls in here; its type is for the annotations only
    from smoe.compute.runner import Runner


def step_draft(runner: Runner, seq: Sequence_, budget: int, stop: frozenset[int]) -> list[int]:
    """A decode step of ``seq`` alone with a prompt-lookup draft (``runner.drafting``):
    verify up to k drafted tokens in one pass (``runner.verify``), or a plain
    ``runner.step`` when there is no draft, drafting is off for this sequence (its
    governor), or the cache cannot be trimmed. Returns the new tokens (1 to ``budget``),
    appended; the last may be in ``stop``, after which nothing is appended. Errors: as
    ``Runner.step`` (the sequence is reset)."""
    d = runner.drafting
    assert d is not None, "step_draft needs a Runner built with drafting"
    if seq.governor is None:
        seq.governor = d.governor()
    gov = seq.governor
    k = min(d.tokens, budget - 1)
    draft: list[int] = []
    if k > 0 and gov.wants_draft() and can_trim_prompt_cache(seq.cache):
        draft = d.drafter.propose(seq.tokens, k)
    start = d.clock()
    if not draft:
        # Build ahead (Runner.step) only while drafting is off: a verify pass would
        # drop the pass built ahead.
        token = runner.step(seq, more=budget > 1 and not gov.drafting)
        gov.plain(d.clock() - start)
        d.stats.plain_steps += 1
        return [token]
    switched = gov.switch_offs
    tokens = runner.verify(seq, draft, stop)
    gov.verified(d.clock() - start, len(tokens))
    d.stats.verify_passes += 1
    d.stats.drafted += len(draft)
    d.stats.accepted += common_prefix(tokens, draft)  # a rejected draft's token differs
    d.stats.switch_offs += gov.switch_offs - switched
    return tokens


def verify(runner: Runner, seq: Sequence_, draft: list[int], stop: frozenset[int]) -> list[int]:
    """Run ``[last token, *draft]`` as one chunk, keep the longest prefix of ``draft`` the
    model accepts and the model's own token after it; the rejected positions leave the
    cache. Acceptance: greedy, the token plain decode picks; sampling, ``accept_sampled``
    on the distribution plain decode samples from. Stops after a token in ``stop``.
    Returns the tokens appended to ``seq.tokens`` (1 to len(draft) + 1)."""
    runner.settle(seq)
    base = len(seq.tokens)
    # Under kernel rules each row is its own decode step, attention included.
    cache = seq.cache if runner.rules is None else [RowSequence(c) for c in seq.cache]
    # y [1, k+1, V]: position j's logits give the token after draft[:j]
    y = runner.evaluated_pass([seq], mx.array([seq.tokens[-1], *draft])[None], cache)
    scored = []  # each token's log-softmax row (the verify pass's logits), where asked
    for j in range(len(draft) + 1):
        guess = draft[j] if j < len(draft) else None
        row = scored_row(seq, y[:, j, :])
        accepted, token = judge(seq, y[:, j, :], guess, runner.drafting)
        seq.tokens.append(token)
        scored.append((seq, row, token))
        if not accepted or token in stop:
            break
    note_scores(scored)
    # The pass put base + k entries in the cache; keep those of the tokens now
    # before the last one.
    trim_prompt_cache(seq.cache, base + len(draft) - (len(seq.tokens) - 1))
    seq.cached = len(seq.tokens) - 1
    return seq.tokens[base:]


def judge(
    seq: Sequence_, logits: mx.array, guess: int | None, drafting: Drafting | None
) -> tuple[bool, int]:
    """The token at ``len(seq.tokens)`` from ``logits`` [1, V], and whether it is ``guess``
    accepted (None: no draft left; the token is drawn as plain decode would). An unseeded
    sampled draw takes ``drafting``'s generator."""
    position = len(seq.tokens)
    params = seq.params
    if params is None or params.temperature == 0:  # greedy: plain decode's own pick
        token = cast(int, draw(seq, logits, position).item())
        return token == guess, token
    logits = processed(seq, logits)
    p = target_probs(logits - mx.logsumexp(logits, axis=-1, keepdims=True), params)
    rng = seeded_rng(seq.seed, position)
    if rng is None:
        assert drafting is not None
        rng = drafting.rng
    if guess is None:
        return False, int(rng.choice(len(p), p=p))
    return accept_sampled(guess, p, rng)
