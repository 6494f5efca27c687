"""Speculation from the router: what the layers guess before the next request needs it.

- ``RouterTap`` keeps a MoE block's router logits for the host (archives, gate echo,
  hints);
- ``gate_ranking``: the experts a token used, then the rest, by gate score;
- ``router_ahead`` / ``look_ahead``: run the next MoE layer's router on this layer's
  input (evaluated with this layer's routing) and queue its top-k as speculative reads
  (decode), scoring the previous guess;
- ``bet_on_next_token`` (gate echo): queue this token's runner-up experts of this layer
  for the next token.
Every guess is only a read queued at speculative priority: routing itself is always
computed from the true hidden state, so a wrong guess costs bytes, never exactness.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from smoe.compute.tracing import Tracer, current_pass


class RouterTap(nn.Module):
    """Wraps a MoE block's router so its logits can be read for the routing archive."""

    def __init__(self, router: nn.Module, layer: int, tracer: Tracer) -> None:
        super().__init__()
        self.router = router
        object.__setattr__(self, "_tracer", tracer)
        object.__setattr__(self, "_layer", layer)

    def __call__(self, x: mx.array) -> mx.array:
        out = self.router(x)
        # Some routers (DeepSeek's MoEGate) return (indices, scores), not logits.
        if isinstance(out, mx.array) and self._tracer.wants_gates():
            current_pass().gates[self._layer] = out
        return out


def gate_ranking(gates: np.ndarray, used: np.ndarray, depth: int) -> np.ndarray:
    """[T, depth] expert ids: the experts used (by descending gate score), then the rest.

    gates: [T, E] router logits; used: [T, k] the experts the block chose.
    """
    t, e = gates.shape
    order = np.argsort(-gates, axis=-1, kind="stable")  # [T, E]
    is_used = np.zeros((t, e), bool)
    np.put_along_axis(is_used, used, True, axis=-1)
    used_first = np.take_along_axis(is_used, order, axis=-1)
    # stable sort on "not used" keeps gate order within the used and within the rest
    ranked = np.take_along_axis(order, np.argsort(~used_first, axis=-1, kind="stable"), -1)
    return ranked[:, :depth]


def router_ahead(tracer: Tracer, layer: int, x: mx.array) -> Any:
    """The next MoE layer's router on this layer's input ``x`` [..., D], lazily (None
    where there is no next MoE layer): built before this layer's routing is read, so one
    evaluation computes both, and ``look_ahead`` then needs no device round trip of its
    own."""
    nxt = tracer.next_layer.get(layer)
    if nxt is None or nxt not in tracer.routers:
        return None
    out = tracer.routers[nxt](x)
    return out.astype(mx.float32) if isinstance(out, mx.array) else out


def look_ahead(
    tracer: Tracer,
    source: Any,
    layer: int,
    x: mx.array,
    idx: np.ndarray,
    prefetch: bool,
    ahead: Any = None,
) -> None:
    """Score this token's experts against the prediction made one layer earlier, then
    run the next MoE layer's router on this layer's input and queue its top-k as
    speculative reads on ``source`` (an approximation: the next layer's true input is not
    known). A routing archive being recorded gets that ranking (``record_ahead``), also
    when nothing is prefetched (``prefetch`` False: prefill, or lookahead off).

    x: [..., D] this layer's input; idx: [..., k] the experts this layer chose; ``ahead``:
    ``router_ahead``'s output for this x, if it was built already."""
    k = idx.shape[-1]
    guess = current_pass().predicted.pop(layer, None)
    if guess is not None:
        used = set(idx.reshape(-1).tolist())
        tracer.counters.lookahead_hits += len(guess & used)
        tracer.counters.lookahead_total += len(used)
    nxt = tracer.next_layer.get(layer)
    if nxt is None or nxt not in tracer.routers:
        return
    recorder = tracer.observers.recorder
    out = ahead if ahead is not None else tracer.routers[nxt](x)
    ranked = _ranked(out, k, max(k, recorder.depth if recorder is not None else k))
    if recorder is not None:
        recorder.record_ahead(nxt, ranked, current_pass().archive_batch)
    if not prefetch:
        return
    top = np.unique(ranked[:, :k]).tolist()  # a batched step: the union of the rows' guesses
    current_pass().predicted[nxt] = set(top)
    source.prefetch(nxt, top)


def _ranked(out: Any, k: int, depth: int) -> np.ndarray:
    """[B, depth] expert ids by descending router score from a router's output ``out``
    (logits [..., E]; or (indices, scores) from a router that selects itself: then its
    own top-k order, [B, k])."""
    if isinstance(out, tuple):
        return np.array(out[0]).reshape(-1, k)
    logits = np.array(out.astype(mx.float32))
    logits = logits.reshape(-1, logits.shape[-1])  # [B, E]
    return np.argsort(-logits, axis=-1, kind="stable")[:, :depth]


def bet_on_next_token(
    tracer: Tracer, source: Any, layer: int, gates: np.ndarray, used: np.ndarray, n: int
) -> None:
    """Gate echo: queue this token's gate ranks k..k+n-1 at ``layer`` as speculative
    reads for the next token (adjacent tokens share experts). The first MoE layer of a
    step first drops the previous token's bets that have not started.

    gates: [1, E] router logits; used: [1, k] the experts the token chose."""
    if layer == tracer.first_layer:
        source.cancel_speculative()
    k = used.shape[-1]
    ranking = gate_ranking(gates, used, k + n)[0, k:]
    source.prefetch(layer, ranking.tolist())
