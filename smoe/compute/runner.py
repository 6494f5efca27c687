"""Forward passes on the compute thread: layer-major prefill and decode steps.

Prefill feeds the prompt in chunks of ``chunk`` tokens. With ``layer_major`` (the default
where the architecture allows it) the chunks advance together one MoE layer at a time
(smoe.compute.prompt_pass), so each layer reads the union of the whole prompt's experts
once; otherwise each chunk runs every layer before the next starts, and each layer reads
the union of that chunk's experts. Every token's bits are the same either way. The LM head is evaluated only where a token is sampled: the prompt's last
token is run on its own, as mlx-lm's generate does, and earlier chunks' logits are never
evaluated (MLX is lazy, so they are never computed).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from smoe.compute.draft import Drafting, accept_sampled, seeded_rng, target_probs
from smoe.compute.logprobs import TokenLogprob, chunk_logprobs, note_scores, scored_row
from smoe.compute.prompt_pass import CHUNK_HALF, PromptPass
from smoe.compute.solo_rows import KernelRules, solo_rows
from smoe.compute.timeline import StepTime, StepTimeline
from smoe.compute.tracing import forward_pass
from smoe.sampling import SamplingParams as SamplingParams  # re-exported: its old home
from smoe.util.tokens import common_prefix as common_prefix  # re-exported


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


@dataclass(eq=False)
class BatchPass:
    """A batched decode pass built ahead (Runner.step_batch): each row's next token, and
    the pass's routing, counted when its tokens are first read (None once counted)."""

    tokens: mx.array  # [B] lazy
    routing: Any = None


def cache_nbytes(seq: Sequence_) -> int:
    """Bytes ``seq``'s KV cache holds (its allocated capacity, quantized or not)."""
    return sum(int(getattr(c, "nbytes", 0)) for c in seq.cache)


def _check_quantizable(cache: list[Any]) -> None:
    """SmoeError unless every layer keeps a full KV cache, the kind mlx-lm quantizes."""
    from mlx_lm.models.cache import KVCache

    from smoe.errors import SmoeError

    kinds = sorted({type(c).__name__ for c in cache if type(c) is not KVCache})
    if kinds:
        raise SmoeError(
            f"--kv-bits needs a model whose layers all keep a full KV cache; this one has "
            f"{', '.join(kinds)} layers (sliding windows or recurrent state), which mlx-lm "
            "cannot quantize: leave --kv-bits out"
        )


def _own(state: Any) -> Any:
    """``state`` (a cache's arrays, nested in tuples) as new arrays of the same bits. mlx-lm's
    caches write in place (``keys[..., i:j, :] = k`` replaces the array's contents for every
    holder of that array), and its KVCache's ``state`` is its arrays themselves: a copy
    holding them would write into the original's cache, and the original into its."""
    if isinstance(state, (tuple, list)):
        return type(state)(_own(x) for x in state)
    return mx.contiguous(state) if isinstance(state, mx.array) else state


def _empty_like(cache: Any) -> Any:
    """An empty cache of ``cache``'s kind (a quantized one keeps its group size and bits)."""
    from mlx_lm.models.cache import QuantizedKVCache

    if isinstance(cache, QuantizedKVCache):
        return QuantizedKVCache(group_size=cache.group_size, bits=cache.bits)
    return type(cache)()


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
            _check_quantizable(self.new_cache())
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

    def _pass(
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
            from mlx_lm.generate import maybe_quantize_kv_cache

            maybe_quantize_kv_cache(cache, 0, self.kv_group_size, self.kv_bits)  # type: ignore[no-untyped-call]

    def _chunk_runner(self, cache: list[Any], logits: bool) -> Callable[[list[int]], Any]:
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

    def _pieces(self, tokens: Sequence[int]) -> list[list[int]]:
        return [list(tokens[i : i + self.chunk]) for i in range(0, len(tokens), self.chunk)]

    def _feed(self, tokens: Sequence[int], cache: list[Any], logits: bool) -> mx.array | None:
        """Run ``tokens`` through the model in chunks; return logits [T, V] if asked."""
        run = self._chunk_runner(cache, logits)
        out: list[Any] = []
        for start in range(0, len(tokens), self.pass_tokens):
            part = tokens[start : start + self.pass_tokens]
            if self.layer_major:
                prompt = PromptPass(run, self._pieces(part))
                while prompt.advance():
                    pass
                out += prompt.results()
            else:
                out += [run(piece) for piece in self._pieces(part)]
        return mx.concatenate(out, axis=0) if logits else None

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits [T, vocab] as float32 numpy, on a fresh cache."""
        cache = self.new_cache()
        y = self._feed(tokens, cache, logits=True)
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
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        self.settle(seq)
        if seq.prompt is not None:  # re-pointed in the middle of a layer-major prefill
            self.reset(seq)
        seq.seed, seq.params, seq.governor = params.seed, params, None
        seq.bias = make_logits_processors(dict(params.logit_bias))[0] if params.logit_bias else None
        seq.scores, seq.prompt_scores = [], None
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
        """Advance the prompt's prefill by one turn; return how many prompt tokens the
        turn worked on (0: the sequence is ready to sample). A turn is one chunk of up to
        ``chunk`` tokens through every layer, or, layer-major, the pass over up to
        ``pass_tokens`` tokens advanced by as many chunk units (a chunk up to its next MoE
        layer) as one chunk takes through every layer, plus any layer served on the way (the experts of every
        chunk at one layer, at once: the longest turn). Between turns nothing is pinned in
        the ring, so other sequences decode (the batcher alternates). A failed turn resets
        ``seq`` and raises."""
        todo = seq.to_prefill()
        if todo == 0:
            return 0
        try:
            scores = seq.prompt_scores  # the prompt's numbers, where asked (extended)
            if not self.layer_major:
                piece = seq.tokens[seq.cached : seq.cached + min(todo, self.chunk)]
                if scores is not None:
                    scores += self._prompt_runner(seq, seq.cached)(piece)
                else:
                    self._feed(piece, seq.cache, logits=False)
                seq.cached += len(piece)
                return len(piece)
            if seq.prompt is None:
                part = seq.tokens[seq.cached : seq.cached + min(todo, self.pass_tokens)]
                run = (
                    self._prompt_runner(seq, seq.cached)
                    if scores is not None
                    else self._chunk_runner(seq.cache, logits=False)
                )
                seq.prompt = PromptPass(run, self._pieces(part))
            tokens = seq.prompt.tokens
            # a chunk's work through every layer: its start, then each layer's experts and
            # the attention after them (half a chunk-layer each)
            if not seq.prompt.advance(self.layers + CHUNK_HALF):
                if scores is not None:
                    scores += [e for r in seq.prompt.results() for e in r or ()]
                seq.prompt = None
                seq.cached += tokens
            return tokens
        except BaseException:
            self.reset(seq)
            raise

    def _prompt_runner(self, seq: Sequence_, start: int) -> Callable[[list[int]], Any]:
        """A chunk runner for a prefill from ``start`` that also scores the prompt: chunk i
        returns the entries of the tokens after its own (``chunk_logprobs``); chunks start
        in prompt order, so each knows where it stands."""
        run = self._chunk_runner(seq.cache, logits=True)
        assert seq.params is not None and seq.params.prompt_logprobs is not None
        k, at = seq.params.prompt_logprobs, [start]

        def score(piece: list[int]) -> list[TokenLogprob]:
            first = at[0]
            at[0] += len(piece)
            targets = seq.tokens[first + 1 : first + 1 + len(piece)]
            return chunk_logprobs(run(piece), targets, k)

        return score

    def reset(self, seq: Sequence_) -> None:
        """Forget ``seq``'s cache (after a failed pass left its layers out of step)."""
        if seq.prompt is not None:  # a layer-major prefill cut short: its chunks end
            seq.prompt.close()
            seq.prompt = None
        seq.cache, seq.cached = self.new_cache(), 0
        seq.ahead, seq.ahead_routing, seq.ahead_pass, seq.ahead_row = None, None, None, None

    def next_logits(self, seq: Sequence_) -> np.ndarray:
        """Logits [vocab] for the token after ``seq.tokens`` (runs its last token)."""
        self.settle(seq)
        y = self._pass([seq], mx.array(seq.tokens[-1:])[None], seq.cache, rules=False)
        seq.cached = len(seq.tokens)
        return np.array(y[0, -1].astype(mx.float32))

    def copy(self, seq: Sequence_) -> Sequence_:
        """An independent copy of ``seq``: its cache's arrays are new arrays (their data
        shared until either side writes: ``_own``), so the two may decode together."""
        if seq.prompt is not None:
            raise RuntimeError("a sequence is copied only between prefills, not during one")
        self.settle(seq)
        cache = self.new_cache()
        self._quantize(cache)  # (an empty cache: quantized iff the sequence's is)
        for i, (mine, theirs) in enumerate(zip(cache, seq.cache, strict=True)):
            if type(mine) is not type(theirs):  # e.g. a quantized cache under kv_bits None
                mine = cache[i] = _empty_like(theirs)
            if not theirs.empty():
                mine.state = _own(theirs.state)
                if hasattr(theirs, "meta_state"):
                    mine.meta_state = theirs.meta_state
        mx.eval([c.state for c in cache if not c.empty()])
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
        y = self._pass([seq], mx.array(seq.tokens[-1:])[None], seq.cache, rules=False)  # [1, 1, V]
        seq.cached = len(seq.tokens)
        return self._sample(seq, y[:, -1, :])

    def _can_build_ahead(self, seq: Sequence_) -> bool:
        from mlx_lm.models.cache import can_trim_prompt_cache

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
                seq.ahead, seq.ahead_routing, seq.ahead_pass, seq.ahead_row = (None,) * 4
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
        token = self._draw(seq, y[:, -1, :], position)
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
        from mlx_lm.models.cache import trim_prompt_cache

        if seq.ahead is not None:
            trim_prompt_cache(seq.cache, 1)
            seq.ahead, seq.ahead_routing, seq.ahead_pass, seq.ahead_row = None, None, None, None

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
            [self._draw(s, y[i : i + 1, -1, :], len(s.tokens)) for i, s in enumerate(seqs)]
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
                    s.ahead, s.ahead_routing, s.ahead_pass, s.ahead_row = None, None, None, None
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
        from smoe.compute.rowwise import RowCaches

        caches = [RowCaches(list(layer)) for layer in zip(*(s.cache for s in seqs), strict=True)]
        y, routing = self._forward(last[:, None], caches, [s.cache for s in seqs], rules=True)
        rows = [scored_row(s, y[i : i + 1, -1, :]) for i, s in enumerate(seqs)]
        tokens = mx.concatenate(  # [B]
            [self._draw(s, y[i : i + 1, -1, :], len(s.tokens) + offset) for i, s in enumerate(seqs)]
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
        from smoe.compute.rowwise import RowCaches

        for s in seqs:
            self.settle(s)
        tokens = mx.array([s.tokens[-1:] for s in seqs])  # [B, 1]
        caches = [RowCaches(list(layer)) for layer in zip(*(s.cache for s in seqs), strict=True)]
        y = self._pass(seqs, tokens, caches)  # [B, 1, V]
        for s in seqs:
            s.cached = len(s.tokens)
        return y

    def step_draft(
        self, seq: Sequence_, budget: int, stop: frozenset[int] = frozenset()
    ) -> list[int]:
        """A decode step of ``seq`` alone with a prompt-lookup draft (``self.drafting``):
        verify up to k drafted tokens in one pass (``verify``), or a plain ``step`` when
        there is no draft, drafting is off for this sequence (its governor), or the cache
        cannot be trimmed. Returns the new tokens (1 to ``budget``), appended; the last may
        be in ``stop``, after which nothing is appended. Greedy: the tokens plain steps
        give; sampling: their distribution. Errors: as ``step`` (the sequence is reset)."""
        from mlx_lm.models.cache import can_trim_prompt_cache

        d = self.drafting
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
            token = self.step(seq, more=budget > 1 and not gov.drafting)
            gov.plain(d.clock() - start)
            d.stats.plain_steps += 1
            return [token]
        switched = gov.switch_offs
        tokens = self.verify(seq, draft, stop)
        gov.verified(d.clock() - start, len(tokens))
        d.stats.verify_passes += 1
        d.stats.drafted += len(draft)
        d.stats.accepted += common_prefix(tokens, draft)  # a rejected draft's token differs
        d.stats.switch_offs += gov.switch_offs - switched
        return tokens

    def verify(
        self, seq: Sequence_, draft: list[int], stop: frozenset[int] = frozenset()
    ) -> list[int]:
        """Run ``[last token, *draft]`` as one chunk (each MoE layer reads the union of
        their experts once), keep the longest prefix of ``draft`` the model accepts and the
        model's own token after it; the rejected positions leave the cache. Acceptance:
        greedy, the token plain decode picks; sampling, ``accept_sampled`` on the
        distribution plain decode samples from. Stops after a token in ``stop``. Returns
        the tokens appended to ``seq.tokens`` (1 to len(draft) + 1)."""
        from mlx_lm.models.cache import trim_prompt_cache

        from smoe.compute.rowwise import RowSequence

        self.settle(seq)
        base = len(seq.tokens)
        # Under kernel rules each row is its own decode step, attention included.
        cache = seq.cache if self.rules is None else [RowSequence(c) for c in seq.cache]
        # y [1, k+1, V]: position j's logits give the token after draft[:j]
        y = self._pass([seq], mx.array([seq.tokens[-1], *draft])[None], cache)
        scored = []  # each token's log-softmax row (the verify pass's logits), where asked
        for j in range(len(draft) + 1):
            guess = draft[j] if j < len(draft) else None
            row = scored_row(seq, y[:, j, :])
            accepted, token = self._judge(seq, y[:, j, :], guess)
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

    def _judge(self, seq: Sequence_, logits: mx.array, guess: int | None) -> tuple[bool, int]:
        """The token at ``len(seq.tokens)`` from ``logits`` [1, V], and whether it is
        ``guess`` accepted (None: no draft left; the token is drawn as plain decode would)."""
        position = len(seq.tokens)
        params = seq.params
        if params is None or params.temperature == 0:  # greedy: plain decode's own pick
            token = cast(int, self._draw(seq, logits, position).item())
            return token == guess, token
        if seq.bias is not None:
            logits = seq.bias(None, logits)
        if seq.processors:
            history = mx.array(seq.tokens)
            for proc in seq.processors:
                logits = proc(history, logits)
        p = target_probs(logits - mx.logsumexp(logits, axis=-1, keepdims=True), params)
        rng = seeded_rng(seq.seed, position)
        if rng is None:
            assert self.drafting is not None
            rng = self.drafting.rng
        if guess is None:
            return False, int(rng.choice(len(p), p=p))
        return accept_sampled(guess, p, rng)

    def _sample(self, seq: Sequence_, logits: mx.array) -> int:
        """Sample from ``logits`` [1, V] with ``seq``'s processors and sampler; append."""
        row = scored_row(seq, logits)
        token = cast(int, self._draw(seq, logits, len(seq.tokens)).item())
        seq.tokens.append(token)
        note_scores([(seq, row, token)])
        return token

    def _draw(self, seq: Sequence_, logits: mx.array, position: int) -> mx.array:
        """The token [1] (lazy) drawn from ``logits`` [1, V] for ``seq.tokens[position]``
        with ``seq``'s logit bias, processors (they read ``seq.tokens``) and sampler."""
        if seq.bias is not None:  # first, as in mlx-lm's make_logits_processors
            logits = seq.bias(None, logits)
        if seq.processors:
            history = mx.array(seq.tokens)
            for p in seq.processors:
                logits = p(history, logits)
        assert seq.sampler is not None
        if seq.seed is not None:  # a draw per position, whatever else shares the step
            mx.random.seed((seq.seed * 1_000_003 + position) % 2**64)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token: mx.array = seq.sampler(logprobs)
        return token
