"""Forward passes on the compute thread: prefill and decode steps (``Runner``).

Prefill feeds the prompt in chunks, plain or layer-major (smoe.compute.prefill); every
token's bits are the same either way. The LM head is evaluated only where a token is
sampled: the prompt's last token is run on its own, as mlx-lm's generate does, and earlier
chunks' logits are never evaluated (MLX is lazy, so they are never computed). Decode steps
run one sequence or a batch (smoe.compute.rowwise), built one step ahead on a resident
model, or verify a prompt-lookup draft (smoe.compute.draft_step).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from smoe.compute import draft_step, prefill
from smoe.compute.draft import Drafting
from smoe.compute.kv_cache import check_quantizable, copy_cache_into
from smoe.compute.logprobs import note_scores, scored_row
from smoe.compute.rowwise import RowCaches
from smoe.compute.sampler import configure, draw
from smoe.compute.sequence import BatchPass, Sequence_
from smoe.compute.solo_rows import KernelRules, solo_rows
from smoe.compute.timeline import StepTime, StepTimeline
from smoe.compute.tracing import forward_pass
from smoe.sampling import SamplingParams
from smoe.util.tokens import common_prefix


class Runner:
    """Runs ``model`` (with streamed experts) on the compute thread.

    ``resident()`` says whether a forward pass needs nothing from the host (every MoE layer
    served from device tables, no routing read back): then a sequence decoding alone is
    built one step ahead, as mlx-lm's ``generate_step`` does, so the device computes step
    n+1 while the host hands out token n (see ``step``).

    ``rules``: where a row's bits depend on the rows sharing its kernel call (a GPU), the
    device's kernel rules; batched and verify passes then run in ``solo_rows``, so each
    row gets its solo decode step's bits (smoe.compute.solo_rows), and a verify pass runs
    attention one row after another. None: the kernels compute rows alone (the CPU).
    """

    def __init__(
        self,
        model: Any,
        chunk: int = 64,
        tracer: Any = None,
        batchable: bool = False,
        resident: Callable[[], bool] | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        drafting: Drafting | None = None,
        rules: KernelRules | None = None,
        layer_major: bool = False,
        pass_tokens: int = 8192,
    ) -> None:
        self.model = model
        # Prefill layer-major over up to ``pass_tokens`` prompt tokens at a time (their
        # activations are held together). Not with a quantized KV cache: mlx-lm converts
        # each cache after the chunk's whole pass, which a layer-major pass interleaves.
        self.layer_major = layer_major and kv_bits is None
        self.layers = len(getattr(model, "layers", ())) or 1  # a prefill turn's work unit
        self.pass_tokens = max(chunk, pass_tokens)
        self.rules = rules
        self.drafting = drafting  # prompt-lookup drafts (step_draft); None: off
        self.chunk = chunk
        # Quantized KV cache (mlx-lm's, from the first token: generate_step with
        # quantized_kv_start=0): every cache is converted after the pass that fills it.
        self.kv_bits = kv_bits
        self.kv_group_size = kv_group_size
        if kv_bits is not None:
            check_quantizable(self.new_cache())
        self.batchable = batchable  # step_batch runs one pass (see smoe.compute.rowwise)
        self.tracer = tracer  # told whether a pass is prefill or decode (routing archive)
        self.resident = resident
        self.built_ahead = 0  # decode passes queued before the previous token was read
        self.timeline = StepTimeline()  # steps built ahead: build, queue, wait (host time)
        self._queue_s = 0.0  # async_eval's time within the step being timed

    def _forward(
        self,
        tokens: mx.array,
        cache: list[Any],
        filled: list[list[Any]],
        phase: int = 1,
        rules: bool = False,
    ) -> tuple[mx.array, Any]:
        """The one place the model runs, lazily: ``tokens`` [B, T] on ``cache`` inside a
        ``forward_pass`` of ``phase`` (``rules``: under the device's kernel rules, each
        row with its solo kernels); then each cache in ``filled`` quantized as mlx-lm's
        generate_step does. Returns the logits [B, T, V] (not evaluated) and the routing
        the pass deferred (``Tracer.take``; None without a tracer), to count once it is."""
        with forward_pass(phase) as state:
            with solo_rows(self.rules) if rules else contextlib.nullcontext():
                y: mx.array = self.model(tokens, cache=cache)
            routing = self.tracer.take(state) if self.tracer is not None else None
        for c in filled:
            self._quantize(c)
        return y, routing

    def _count(self, routing: Any) -> None:
        """Count a pass's deferred routing once the pass has been evaluated."""
        if self.tracer is not None:
            self.tracer.count(routing)

    def evaluated_pass(
        self, seqs: list[Sequence_], tokens: mx.array, cache: list[Any], rules: bool = True
    ) -> mx.array:
        """The evaluated decode pass (plain, batched, verify, next_logits): ``_forward``
        on ``seqs``' ``cache``, evaluated, its routing counted. Returns the logits
        [B, T, V]. If the pass fails, every sequence in ``seqs`` is reset (its layers
        would be out of step) and the error raised."""
        try:
            y, routing = self._forward(tokens, cache, [s.cache for s in seqs], rules=rules)
            mx.eval(y, *([routing.ids] if routing is not None else []))
            self._count(routing)
        except BaseException:
            for s in seqs:
                self.reset(s)
            raise
        return y

    def new_cache(self) -> list[Any]:
        return make_prompt_cache(self.model)

    def _quantize(self, cache: list[Any]) -> None:
        """After a pass: turn ``cache``'s float layers into quantized ones (in place), as
        mlx-lm's generate_step does after each model call, so the arithmetic is its own."""
        if self.kv_bits is not None:
            maybe_quantize_kv_cache(cache, 0, self.kv_group_size, self.kv_bits)  # type: ignore[no-untyped-call]

    def chunk_runner(self, cache: list[Any], logits: bool) -> Callable[[list[int]], Any]:
        """One chunk's pass on ``cache``: its logits [T, V] evaluated if asked, else its
        layers only (the LM head's output is never computed)."""

        def run(piece: list[int]) -> mx.array | None:
            y, routing = self._forward(mx.array(piece)[None], cache, [cache], phase=0)
            if logits:
                mx.eval(y)
            else:
                mx.eval([c.state for c in cache])  # the layers, not the LM head
            self._count(routing)
            return y[0] if logits else None

        return run

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits [T, vocab] as float32 numpy, on a fresh cache."""
        cache = self.new_cache()
        y = prefill.feed(self, tokens, cache, logits=True)
        assert y is not None
        return np.array(y.astype(mx.float32))

    def start(self, prompt: Sequence[int], params: SamplingParams) -> Sequence_:
        """Prefill all but the prompt's last token (their logits are never computed)."""
        seq = Sequence_(cache=self.new_cache())
        self.extend(seq, prompt, params)
        return seq

    def extend(self, seq: Sequence_, prompt: Sequence[int], params: SamplingParams) -> int:
        """Make ``seq`` ready to sample after ``prompt`` (the whole new stream), reusing the
        cached prefix they share. Returns how many tokens were prefilled."""
        n = self.prepare(seq, prompt, params)
        while self.prefill_chunk(seq):
            pass
        return n

    def prepare(self, seq: Sequence_, prompt: Sequence[int], params: SamplingParams) -> int:
        """Point ``seq`` at ``prompt`` (the whole new stream): set its sampler, trim its
        cache to the prefix they share. Returns how many tokens ``prefill_chunk`` must
        then run (all but the prompt's last token, minus the reused prefix)."""
        self.settle(seq)
        if seq.prompt is not None:  # re-pointed in the middle of a layer-major prefill
            self.reset(seq)
        seq.seed, seq.params, seq.governor = params.seed, params, None
        seq.scores, seq.prompt_scores = [], None
        configure(seq, params)  # its logit bias, sampler and processors
        prompt = list(prompt)
        keep = common_prefix(seq.tokens[: seq.cached], prompt)
        keep = min(keep, len(prompt) - 1)  # the last token must run to give logits
        if params.prompt_logprobs is not None:  # every prompt token's logits: from the start
            seq.cache, keep, seq.prompt_scores = self.new_cache(), 0, []
        elif keep < seq.cached:
            if can_trim_prompt_cache(seq.cache):
                trim_prompt_cache(seq.cache, seq.cached - keep)
            else:  # e.g. a sliding-window cache: start over
                seq.cache, keep = self.new_cache(), 0
        seq.tokens, seq.cached = prompt, keep
        return seq.to_prefill()

    def prefill_chunk(self, seq: Sequence_) -> int:
        """Advance the prompt's prefill by one turn; return how many prompt tokens the turn
        worked on (0: the sequence is ready to sample). A failed turn resets ``seq`` and
        raises (smoe.compute.prefill.prefill_chunk)."""
        return prefill.prefill_chunk(self, seq)

    def reset(self, seq: Sequence_) -> None:
        """Forget ``seq``'s cache (after a failed pass left its layers out of step)."""
        if seq.prompt is not None:  # a layer-major prefill cut short: its chunks end
            seq.prompt.close()
            seq.prompt = None
        seq.cache, seq.cached = self.new_cache(), 0
        seq.forget_ahead()

    def next_logits(self, seq: Sequence_) -> np.ndarray:
        """Logits [vocab] for the token after ``seq.tokens`` (runs its last token)."""
        self.settle(seq)
        y = self.evaluated_pass([seq], mx.array(seq.tokens[-1:])[None], seq.cache, rules=False)
        seq.cached = len(seq.tokens)
        return np.array(y[0, -1].astype(mx.float32))

    def copy(self, seq: Sequence_) -> Sequence_:
        """An independent copy of ``seq``: its cache's arrays are new arrays (their data
        shared until either side writes: ``kv_cache.own``), so the two may decode together."""
        if seq.prompt is not None:
            raise RuntimeError("a sequence is copied only between prefills, not during one")
        self.settle(seq)
        cache = self.new_cache()
        self._quantize(cache)  # (an empty cache: quantized iff the sequence's is)
        copy_cache_into(cache, seq.cache)
        return Sequence_(cache=cache, tokens=list(seq.tokens), cached=seq.cached)

    def step(self, seq: Sequence_, more: bool = True) -> int:
        """Run the last token, sample the next one, append it; return it.

        On a resident model (see the class docstring) the pass for the token returned is
        also queued on the device before it is read back, unless ``more`` is False (the
        caller will not ask for another); ``settle`` undoes that when the sequence is used
        otherwise. The tokens are the same either way: only the order of work changes.
        """
        if self._can_build_ahead(seq):
            return self._step_ahead(seq, more)
        self.settle(seq)
        last = mx.array(seq.tokens[-1:])[None]  # [1, 1]
        y = self.evaluated_pass([seq], last, seq.cache, rules=False)  # [1, 1, V]
        seq.cached = len(seq.tokens)
        return self._sample(seq, y[:, -1, :])

    def _can_build_ahead(self, seq: Sequence_) -> bool:
        # Processors read the token history on the host; a cache that cannot be trimmed
        # could not drop the pass built ahead.
        return (
            self.resident is not None
            and self.resident()
            and not seq.processors
            and can_trim_prompt_cache(seq.cache)
        )

    def _step_ahead(self, seq: Sequence_, more: bool) -> int:
        """``step`` with the next pass queued before this token is read back."""
        start, self._queue_s = time.perf_counter(), 0.0
        try:
            if seq.ahead is None:
                last = mx.array(seq.tokens[-1:])
                token, routing, row = self._build_step(seq, last, len(seq.tokens))
            else:
                # (a row of a batched pass, too: its token and cache entry are its own)
                token, routing, row = seq.ahead, seq.ahead_routing, seq.ahead_row
                seq.forget_ahead()
            if more:
                # token [1] feeds the next pass lazily: it puts this token's keys and
                # values in the cache and samples the one after it.
                ahead = self._build_step(seq, token, len(seq.tokens) + 1)
                seq.ahead, seq.ahead_routing, seq.ahead_row = ahead
                self.built_ahead += 1
            built = time.perf_counter()
            value = cast(int, token.item())  # waits for this step's pass only
            self._time_step(1, start, built)
            self._count(routing)
        except BaseException:
            self.reset(seq)
            raise
        seq.cached = len(seq.tokens)
        seq.tokens.append(value)
        note_scores([(seq, row, value)])
        return value

    def _build_step(
        self, seq: Sequence_, last: mx.array, position: int
    ) -> tuple[mx.array, Any, mx.array | None]:
        """Queue the lazy decode pass on ``last`` [1]; return its sampled token [1]
        (``position``: the index it will have in ``seq.tokens``), its routing
        (``_queue``) and the log-softmax row of its logits where asked (``scored_row``)."""
        y, routing = self._forward(last[None], seq.cache, [seq.cache])  # [1, 1, V]
        row = scored_row(seq, y[:, -1, :])
        token = draw(seq, y[:, -1, :], position)
        return token, self._queue(token, routing, [row]), row

    def _queue(self, token: mx.array, routing: Any, rows: Sequence[Any] = ()) -> Any:
        """Start evaluating a built pass (its token, its routing's ids and any log-softmax
        ``rows``); return the routing, to count once the token has been read."""
        start = time.perf_counter()
        extra = [r for r in rows if r is not None]
        mx.async_eval(token, *([routing.ids] if routing is not None else []), *extra)  # type: ignore[no-untyped-call]
        self._queue_s += time.perf_counter() - start
        return routing

    def _time_step(self, rows: int, start: float, queued: float) -> None:
        """Note a step built ahead in the timeline: ``start`` to ``queued`` was building
        and queueing (``_queue_s`` of it queueing), the rest until now waiting."""
        wait = time.perf_counter() - queued
        build = queued - start - self._queue_s
        self.timeline.add(StepTime(rows, start, build, self._queue_s, wait))

    def settle(self, seq: Sequence_) -> None:
        """Drop a pass built ahead (``step``): its keys/values leave the cache, its routing
        is not counted. Every other use of the sequence starts here."""
        if seq.ahead is not None:
            trim_prompt_cache(seq.cache, 1)
            seq.forget_ahead()

    def step_batch(self, seqs: list[Sequence_], more: bool = True) -> list[int]:
        """One decode step of every sequence in ``seqs`` together: per MoE layer the union
        of their experts is acquired once. Each sequence's logits and token are those of
        ``step`` on it alone. If the pass fails, every sequence in it is reset. ``more``:
        see ``step`` (False when no sequence will be stepped again)."""
        if len(seqs) == 1 or not self.batchable:
            return [self.step(s, more) for s in seqs]
        if all(self._can_build_ahead(s) for s in seqs):
            return self._step_batch_ahead(seqs, more)
        y = self._forward_batch(seqs)  # [B, 1, V]
        rows = [scored_row(s, y[i : i + 1, -1, :]) for i, s in enumerate(seqs)]
        tokens = mx.concatenate(  # [B]: every row's draw, read back in one sync
            [draw(s, y[i : i + 1, -1, :], len(s.tokens)) for i, s in enumerate(seqs)]
        )
        values = self._append(seqs, tokens)
        note_scores(list(zip(seqs, rows, values, strict=True)))
        return values

    def _step_batch_ahead(self, seqs: list[Sequence_], more: bool) -> list[int]:
        """``step_batch`` with the next batched pass queued before this step's tokens are
        read back, as ``_step_ahead`` does for one sequence. The pass built ahead is used
        when every row comes from it (rows may have left the batch since: those rows are
        settled by their next use); any other batch settles its rows and runs afresh."""
        start, self._queue_s = time.perf_counter(), 0.0
        try:
            built = seqs[0].ahead_pass
            if built is not None and all(s.ahead_pass is built for s in seqs):
                now = mx.concatenate([s.ahead for s in seqs if s.ahead is not None])  # [B]
                assert now.shape == (len(seqs),), "a row of a pass built ahead lost its token"
                routing, built.routing = built.routing, None  # one count per pass
                rows = [s.ahead_row for s in seqs]
                for s in seqs:
                    s.forget_ahead()
            else:
                for s in seqs:
                    self.settle(s)
                last = mx.array([s.tokens[-1] for s in seqs])  # [B]
                now, routing, rows = self._build_batch(seqs, last, 0)
            if more:
                # now [B] feeds the next pass lazily, as in _step_ahead.
                nxt, nxt_routing, nxt_rows = self._build_batch(seqs, now, 1)
                built = BatchPass(nxt, nxt_routing)
                for i, s in enumerate(seqs):
                    s.ahead, s.ahead_pass, s.ahead_row = nxt[i : i + 1], built, nxt_rows[i]
                self.built_ahead += 1
            queued = time.perf_counter()
            values = cast(list[int], now.tolist())  # waits for this step's pass only
            self._time_step(len(seqs), start, queued)
            self._count(routing)
        except BaseException:
            for s in seqs:
                self.reset(s)
            raise
        for s, value in zip(seqs, values, strict=True):
            s.cached = len(s.tokens)
            s.tokens.append(value)
        note_scores(list(zip(seqs, rows, values, strict=True)))
        return values

    def _build_batch(
        self, seqs: list[Sequence_], last: mx.array, offset: int
    ) -> tuple[mx.array, Any, list[mx.array | None]]:
        """Queue the lazy batched pass on ``last`` [B] (row i: ``seqs[i]``'s last token,
        ``offset`` tokens past ``seqs[i].tokens``); return its sampled tokens [B], its
        routing (``_queue``) and each row's log-softmax where asked (``scored_row``)."""
        caches = [RowCaches(list(layer)) for layer in zip(*(s.cache for s in seqs), strict=True)]
        y, routing = self._forward(last[:, None], caches, [s.cache for s in seqs], rules=True)
        rows = [scored_row(s, y[i : i + 1, -1, :]) for i, s in enumerate(seqs)]
        tokens = mx.concatenate(  # [B]
            [draw(s, y[i : i + 1, -1, :], len(s.tokens) + offset) for i, s in enumerate(seqs)]
        )
        return tokens, self._queue(tokens, routing, rows), rows

    def _append(self, seqs: list[Sequence_], tokens: mx.array) -> list[int]:
        """Read ``tokens`` [B] back (one sync) and append row i's to ``seqs[i]``."""
        values = cast(list[int], tokens.tolist())
        for s, value in zip(seqs, values, strict=True):
            s.tokens.append(value)
        return values

    def next_logits_batch(self, seqs: list[Sequence_]) -> np.ndarray:
        """``next_logits`` of each sequence, from one batched pass: [B, vocab] float32."""
        if not self.batchable:
            return np.stack([self.next_logits(s) for s in seqs])
        return np.array(self._forward_batch(seqs)[:, -1].astype(mx.float32))

    def _forward_batch(self, seqs: list[Sequence_]) -> mx.array:
        """Run each sequence's last token in one pass ([B, 1] tokens, per-row caches)."""
        for s in seqs:
            self.settle(s)
        tokens = mx.array([s.tokens[-1:] for s in seqs])  # [B, 1]
        caches = [RowCaches(list(layer)) for layer in zip(*(s.cache for s in seqs), strict=True)]
        y = self.evaluated_pass(seqs, tokens, caches)  # [B, 1, V]
        for s in seqs:
            s.cached = len(s.tokens)
        return y

    def step_draft(
        self, seq: Sequence_, budget: int, stop: frozenset[int] = frozenset()
    ) -> list[int]:
        """A decode step of ``seq`` alone with a prompt-lookup draft (``self.drafting``):
        up to ``budget`` new tokens, appended (smoe.compute.draft_step.step_draft)."""
        return draft_step.step_draft(self, seq, budget, stop)

    def verify(
        self, seq: Sequence_, draft: list[int], stop: frozenset[int] = frozenset()
    ) -> list[int]:
        """Run ``[last token, *draft]`` in one pass; append the accepted prefix of ``draft``
        and the model's token after it; return them (smoe.compute.draft_step.verify)."""
        return draft_step.verify(self, seq, draft, stop)

    def _sample(self, seq: Sequence_, logits: mx.array) -> int:
        """Sample from ``logits`` [1, V] with ``seq``'s processors and sampler; append."""
        row = scored_row(seq, logits)
        token = cast(int, draw(seq, logits, len(seq.tokens)).item())
        seq.tokens.append(token)
        note_scores([(seq, row, token)])
        return token
