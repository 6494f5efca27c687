"""Log-probabilities of tokens, from the logits the runner computes anyway.

A token's log-probability is the log-softmax of the model's logits at its position in
float32, ``x - logsumexp(x)`` with ``x`` the logits cast to float32: what mlx-lm's
``generate_step`` returns as ``logprobs`` for a float32 model with no logits processors
(for a bfloat16 model, its logits cast exactly to float32 first). Logit bias and the
penalties are not applied (vLLM's default, "raw" log-probabilities): they change which
token is drawn, not what the model gave it. The alternatives (``top``) are the
``k`` likeliest tokens, likeliest first, ties by the lower id.

The runner builds the log-softmax lazily beside the draw (``log_softmax``), so nothing is
computed for a request that does not ask, and reads it back with the token
(``token_logprob``). The prompt's log-probabilities come from the prefill's logits, chunk
by chunk (``chunk_logprobs``), so a long prompt never holds [tokens, vocab] at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from smoe.sampling import TokenLogprob as TokenLogprob  # re-exported


def log_softmax(logits: mx.array) -> mx.array:
    """``logits`` [..., V] (lazy) -> their float32 log-softmax over the vocabulary (lazy)."""
    x = logits.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def top_logprobs(row: np.ndarray, k: int) -> tuple[tuple[int, float], ...]:
    """The ``k`` largest entries of ``row`` [V] as (id, value), largest first, equal values
    by the lower id (so the choice at the k-th place never depends on the kernel)."""
    k = min(k, row.size)
    if k <= 0:
        return ()
    kth = row[np.argpartition(-row, k - 1)[k - 1]]
    ids = np.flatnonzero(row >= kth)  # every tie at the k-th place (NaN never counts)
    order = np.lexsort((ids, -row[ids]))[:k]
    return tuple((int(i), float(row[i])) for i in ids[order])


def token_logprob(row: mx.array, token: int, k: int) -> TokenLogprob:
    """``token``'s entry of ``row`` ([1, V] or [V], from ``log_softmax``) and, for k > 0,
    its ``k`` likeliest tokens (the row is read back whole only then)."""
    row = row.reshape(-1)
    if k <= 0:
        return TokenLogprob(token, float(np.array(row[token])))
    host = np.array(row)
    return TokenLogprob(token, float(host[token]), top_logprobs(host, k))


def chunk_logprobs(logits: mx.array, targets: Sequence[int], k: int) -> list[TokenLogprob]:
    """Row i of ``logits`` [n, V] scored at ``targets[i]`` (the token after row i's), for
    the first len(targets) rows. Evaluates what it needs; holds nothing of [n, V] after."""
    n = len(targets)
    if n == 0:
        return []
    rows = log_softmax(logits[:n])
    if k <= 0:
        picked = mx.take_along_axis(rows, mx.array(list(targets))[:, None], axis=-1)
        values = np.array(picked).reshape(-1)
        return [TokenLogprob(int(t), float(v)) for t, v in zip(targets, values, strict=True)]
    host = np.array(rows)
    return [
        TokenLogprob(int(t), float(host[i, t]), top_logprobs(host[i], k))
        for i, t in enumerate(targets)
    ]


def scored_row(seq: Any, logits: mx.array) -> mx.array | None:
    """The float32 log-softmax of ``logits`` [1, V] (lazy; before any bias or processor)
    if the runner's sequence ``seq`` asks for log-probabilities; else None, and no work."""
    if seq.params is None or seq.params.logprobs is None:
        return None
    return log_softmax(logits)


def note_scores(scored: Sequence[tuple[Any, mx.array | None, int]]) -> None:
    """Each (sequence, row from ``scored_row``, token appended)'s entry to the sequence's
    ``scores``, the rows read back together (no row: not asked, nothing done)."""
    asked = [(s, row, t) for s, row, t in scored if row is not None]
    if not asked:
        return
    mx.eval([row for _, row, _ in asked])
    for s, row, t in asked:
        s.scores.append(token_logprob(row, t, s.params.logprobs))
