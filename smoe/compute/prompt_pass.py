"""Layer-major prefill over a whole prompt: each MoE layer's experts read once per prompt.

The prompt runs as chunks, each chunk its own model call (mlx-lm's code, unchanged), each
in a greenlet on the compute thread. A streamed MoE layer met inside a chunk hands its
input and routing to the pass and suspends (``ask``); once every chunk has reached that
layer, the pass serves the layer for all of them at once (the union of their experts read
once, in waves where the ring is smaller: ``StreamingExperts.prompt_layer_steps``), then
resumes the chunks in order, each up to its next MoE layer. The caller may stop between
any two chunk units (a chunk started or resumed) and let other requests decode.

Why the bits do not change: at every layer the chunks run their attention in prompt order,
each after the previous chunk has put its keys and values in that layer's cache, so each
chunk sees the cache it sees in chunk-by-chunk prefill and makes the same calls; each
chunk's expert call is computed with its own call's shape and kernels (waves as
``StreamingExperts`` computes them). What a chunk computes before its first MoE layer
(embedding, masks) reads the first layer's cache, which the earlier chunks have filled
by then (``layer_major_prefill`` in smoe.models.registry says where that holds).

Between two ``advance`` calls the pass holds no ring slot: other sequences may decode.
Everything here runs on one thread (greenlets cannot cross threads).
"""

from __future__ import annotations

import contextvars
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np
from greenlet import GreenletExit, greenlet


class PromptLayer(Protocol):
    """A MoE layer that can serve several chunks' calls together (StreamingExperts)."""

    layer: int

    def prompt_layer_steps(
        self, calls: list[tuple[mx.array, np.ndarray]]
    ) -> Generator[float, None, list[mx.array]]:
        """Each (x [..., D], expert ids [..., k] on the host) call's output [..., k, D],
        in order, computed in steps; each yield follows a step and gives its work in
        chunks' expert calls (the caller may run other work there)."""
        ...


@dataclass
class _Ask:
    """A chunk suspended at a MoE layer, waiting for that layer's output."""

    module: PromptLayer
    x: mx.array
    indices: np.ndarray  # the chunk's routing, evaluated


class _Chunk(greenlet):  # type: ignore[misc]  # greenlet's stubs: subclassing is untyped
    """One chunk's model call, suspended at each streamed MoE layer."""

    def ask(self, module: PromptLayer, x: mx.array, indices: np.ndarray) -> mx.array:
        """Suspend until the pass has served ``module`` for every chunk; its output."""
        out = self.parent.switch(_Ask(module, x, indices))
        assert isinstance(out, mx.array)
        return out


# A chunk's attention at one layer (a start or a resume), or its experts there: half of
# that chunk's work at the layer, the unit a caller budgets turns in.
CHUNK_HALF = 0.5
# Attention's cost grows with the context: a chunk's attention half counts once per this
# many tokens of context before its end (at least once), so that a turn of late chunks
# is not several times longer than one of early chunks (docs/performance.md, the gap).
CONTEXT_UNIT = 512


def current_chunk() -> _Chunk | None:
    """The chunk of a prompt pass running now, if any (a MoE layer then asks it)."""
    g = greenlet.getcurrent()
    return g if isinstance(g, _Chunk) else None


class PromptPass:
    """The chunks of one prompt, advanced a unit of work at a time.

    ``run_chunk(piece)`` runs one chunk's model call (its KV appended to the cache the
    caller gave it) and returns what the caller wants of it (logits, or None). A unit
    (``step``) is one chunk started or resumed, which runs it up to its next MoE layer (its
    attention there, costed by its context: ``CONTEXT_UNIT``), or, once every chunk waits at a layer, a step of serving that layer
    for all of them (``PromptLayer.prompt_layer_steps``: the union read once, then a chunk
    or a wave a step). ``advance(budget)`` runs units until ``budget`` chunk units are spent (None: to
    the end), so a caller can stop between any two chunks and let other work run; ``done``
    says whether every chunk has finished, and ``results`` gives their return values in
    order. A failure in any chunk ends the pass (``close``) and is raised; the caller's
    cache is then out of step and must be reset."""

    def __init__(self, run_chunk: Callable[[list[int]], Any], pieces: Sequence[list[int]]):
        self._run_chunk = run_chunk
        self._pieces = [list(p) for p in pieces]
        self._chunks: list[_Chunk] = []
        self._asks: list[_Ask | None] = []
        self._outs: deque[tuple[int, mx.array]] = deque()  # served, not yet resumed
        self._serving: Generator[float, None, list[mx.array]] | None = None  # a layer's
        self._served: list[int] = []  # the chunks the layer being served is for
        self._results: list[Any] = [None] * len(self._pieces)
        self.layers_served = 0

    @property
    def tokens(self) -> int:
        return sum(len(p) for p in self._pieces)

    @property
    def done(self) -> bool:
        return (
            len(self._chunks) == len(self._pieces)
            and not self._outs
            and self._serving is None
            and all(a is None for a in self._asks)
        )

    def results(self) -> list[Any]:
        assert self.done
        return self._results

    def advance(self, budget: float | None = None) -> bool:
        """Run units until ``budget`` of work is spent (in chunk-layers: a chunk's attention
        at one layer is half, its experts there the other half; None: until done); returns
        True while the pass has more to do."""
        spent = 0.0
        while not self.done and (budget is None or spent < budget):
            spent += self.step()
        return not self.done

    def step(self) -> float:
        """One unit: a step of the layer being served, else resume the next served chunk,
        else start the next chunk, else begin serving the layer every chunk waits at.
        Returns its work in chunk-layers (0 when there was nothing to do)."""
        try:
            if self._serving is not None:
                try:
                    return CHUNK_HALF * next(self._serving)
                except StopIteration as served:
                    self._serving = None
                    self.layers_served += 1
                    self._outs.extend(zip(self._served, served.value, strict=True))
            if self._outs:
                i, out = self._outs.popleft()
                self._asks[i] = self._settle(i, self._chunks[i].switch(out))
                return self._attention(i)
            if len(self._chunks) < len(self._pieces):
                i = len(self._chunks)
                chunk = _Chunk(self._run_chunk)
                chunk.gr_context = contextvars.copy_context()  # the caller's settings
                self._chunks.append(chunk)
                self._asks.append(self._settle(i, chunk.switch(self._pieces[i])))
                return self._attention(i)
            waiting = [(i, a) for i, a in enumerate(self._asks) if a is not None]
            if not waiting:
                return 0.0
            module = waiting[0][1].module
            if any(a.module is not module for _, a in waiting) or len(waiting) != len(self._chunks):
                raise RuntimeError("the chunks of a prompt pass left step with each other")
            self._served = [i for i, _ in waiting]
            self._serving = module.prompt_layer_steps([(a.x, a.indices) for _, a in waiting])
            return self.step()
        except BaseException:
            self.close()
            raise

    def _attention(self, i: int) -> float:
        """The work of chunk ``i``'s attention at a layer: a half per CONTEXT_UNIT tokens
        of the context it attends to (at least one half)."""
        context = sum(len(p) for p in self._pieces[: i + 1])
        return CHUNK_HALF * max(1.0, context / CONTEXT_UNIT)

    def _settle(self, i: int, what: Any) -> _Ask | None:
        """A chunk's switch came back: suspended at a layer (its ask), or finished."""
        if isinstance(what, _Ask) and not self._chunks[i].dead:
            return what
        self._results[i] = what
        return None

    def close(self) -> None:
        """End every suspended chunk (its forward pass's state is dropped)."""
        for chunk in self._chunks:
            if not chunk.dead:
                chunk.throw(GreenletExit)  # unwinds it; GreenletExit is not re-raised here
        self._asks = [None] * len(self._chunks)
        self._outs.clear()
        if self._serving is not None:
            self._serving.close()  # (nothing is pinned at its yields)
            self._serving = None
