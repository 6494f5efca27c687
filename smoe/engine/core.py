"""The async API: open a vault, get logits, generate.

    async with smoe.Engine.open("vault", memory="6GB") as engine:
        logits = await engine.logits([1, 2, 3])           # numpy float32 [T, vocab]
        async for event in engine.generate("Hello", max_tokens=32):
            print(event.text, end="")

Cancellation: breaking out of ``generate`` or cancelling the task that iterates it stops the
generation after the step in progress (a running MLX step cannot be interrupted; it takes
one token's time). The engine stays usable; the next call starts once that step is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import anyio
import numpy as np

from smoe.compute.sequence import Sequence_
from smoe.compute.tracing import Tracer
from smoe.engine.batcher import Ticket
from smoe.engine.build import EngineParts, open_parts
from smoe.engine.events import Event, GenerationStats
from smoe.engine.group import Group, make_group, point
from smoe.engine.handles import SequenceHandle
from smoe.engine.learning import Learning
from smoe.engine.mirror import Request
from smoe.engine.requests import ticket_events
from smoe.engine.stats import EngineInternals, EngineStats, engine_stats
from smoe.errors import SmoeError, VaultError
from smoe.io import disk_probe
from smoe.io.disk_probe import DEFAULT_WORKERS
from smoe.plan.options import EngineOptions
from smoe.plan.plan import Plan
from smoe.plan.plan import plan as plan_engine
from smoe.sampling import SamplingParams
from smoe.util.allocator import bound_malloc, limit_mlx_cache
from smoe.vault.format import Vault
from smoe.vault.source import open_model

if TYPE_CHECKING:
    from smoe.engine.conversation import Conversation

log = logging.getLogger("smoe.engine")


def _batchable(model_type: str) -> bool:
    """Whether S-MoE runs this architecture's attention one row per call (batched decode,
    and verify passes under kernel rules; smoe.compute.rowwise)."""
    from smoe.models.registry import architecture

    arch = architecture(model_type)
    return arch is not None and arch.batched_decode


class Engine:
    """A vault (or a checkpoint folder, streamed from its shards) opened for inference.
    Create with ``Engine.open`` and use as ``async with``."""

    def __init__(self, vault: Vault | str | Path, options: EngineOptions) -> None:
        # A vault, or a checkpoint folder streamed from its shards (docs/sources.md).
        self.vault = vault if isinstance(vault, Vault) else open_model(vault)
        self.options = options
        self._tracer = Tracer(spec=options.spec, lookahead=options.lookahead)
        self.learning = Learning(self, self._tracer)  # pre-warm, warm-up, routing archive
        self._lock = asyncio.Lock()  # one job at a time on the compute thread
        self._opened = False
        self._parts: EngineParts | None = None  # the parts, while open (smoe.engine.build)
        self._group: Group | None = None  # collectives and leading, while open
        self._stack = contextlib.AsyncExitStack()  # every part's way down (``aclose``)
        self._plan: Plan | None = None
        self.dtype: Any = None  # the compute dtype (an mx.Dtype), once open
        self.max_context = 0  # tokens a sequence may hold, once open
        # I/O threads: options.workers, or the disk's choice when the engine opens
        self._workers = options.workers or DEFAULT_WORKERS
        # What opening decided, for the user: how --memory divided, the host tier's size,
        # how the I/O workers were chosen (each where there is one), as logged.
        self.start_lines: list[str] = []
        # The backbone's hash running in the background (see __aenter__), or None.
        self._backbone_check: asyncio.Future[bool] | None = None

    @classmethod
    def open(
        cls, vault: Vault | str | Path, memory: int | str | None = None, **options: Any
    ) -> Engine:
        """An engine for ``vault``: a vault, or a downloaded checkpoint folder streamed
        from its shards (not started: use ``async with``). Options: see EngineOptions.
        Raises VaultError for a bad vault, CheckpointError or UnsupportedModelError for a
        folder that cannot be streamed (naming the fix), SmoeError for a bad option."""
        return cls(vault, EngineOptions(memory=memory, **options))

    # ---------------------------------------------------------------- lifecycle
    async def __aenter__(self) -> Engine:
        """Check every option, then start, in order: the compute thread, the ring, the I/O
        workers and the scheduler, the model and the batcher. A failure on the way closes
        what was started (``aclose``) and raises it: SmoeError for a bad option or budget,
        VaultError for a vault that does not verify."""
        self._check_shard_alone()
        if self.options.memory is not None:  # a promise: what malloc keeps, bounded
            bound_malloc()  # (the CLI did it before any thread; here for the Python API)
        workers_line = None
        if self.options.workers is None:
            self._workers, workers_line = await self._auto_workers()
        plan = self._check_and_plan()
        if plan.ring.fit is not None:  # how a whole-process --memory divided
            self.start_lines.append(plan.ring.fit.line())
        if plan.host_tier.images:
            self.start_lines.append(
                f"{plan.host_tier.line()} beside a ring of {plan.ring.slots:,} (misses it "
                "holds are copied over the bus, not read from the disk)"
            )
        if workers_line is not None:
            self.start_lines.append(workers_line)
        for line in self.start_lines:
            log.info(line)
        # The backbone is untrusted: hash it before loading it, or, where its last hash was
        # good and its metadata has not changed since, in the background while the engine
        # opens (bit rot keeps metadata); every request waits for that before its first
        # token (``_backbone_checked``).
        if self.vault.backbone_remembered():
            rehash = functools.partial(self.vault.verify_backbone, force=True)
            self._backbone_check = asyncio.ensure_future(anyio.to_thread.run_sync(rehash))
        else:
            await anyio.to_thread.run_sync(self.vault.verify_backbone)
        try:
            self._limit_mlx_cache(plan)
            self._parts = await open_parts(
                self.vault, self.options, plan, self._workers, self._tracer, self._lock, self._stack
            )
        except BaseException:
            await self.aclose()
            raise
        m = self.vault.manifest
        self._group = make_group(
            self._parts, self._parts.ranks, m.num_records, self._lock, self._stack
        )
        self._opened = True
        return self

    def _limit_mlx_cache(self, plan: Plan) -> None:
        """Under a budget on the CPU, MLX's buffer cache capped at what working memory
        counts for it (``Fit.cache``; MLX's default is 32 MB whatever the budget), until
        the engine closes (docs/plan.md). A GPU's cache is left as MLX sets it."""
        fit = plan.ring.fit
        if fit is None or plan.device.gpu:
            return
        previous = limit_mlx_cache(fit.cache)
        self._stack.callback(limit_mlx_cache, previous)

    def _check_shard_alone(self) -> None:
        """A shard holds one rank's experts: alone it would fail at the first expert it lacks."""
        shard = self.vault.manifest.shard
        if shard is not None and self.options.distributed is None:
            raise VaultError(
                f"{self.vault.path} is the shard of rank {shard.rank} of {shard.ranks} (some "
                f"experts only): run every rank's shard with mlx.launch and --distributed "
                f"(docs/distributed.md), or run the full vault"
            )

    def _check_and_plan(self) -> Plan:
        """Options checked, device and dtype chosen, the ring planned (smoe.plan.plan, the
        call `smoe plan` makes too): nothing started."""
        p = plan_engine(
            self.vault,
            self.options,
            workers=self._workers,
            batchable=_batchable(self.vault.config()["model_type"]),
        )
        self._plan, self.dtype, self.max_context = p, p.dtype, p.max_context
        return p

    async def _auto_workers(self) -> tuple[int, str | None]:
        """The disk's worker count and how it was chosen (a probe runs on a thread; a
        small model needs none, and gets no thread)."""
        path = self.vault.experts_path
        stride, size = self.vault.manifest.record.stride, path.stat().st_size
        if size < disk_probe.AUTO_PROBE_MIN_BYTES:
            return DEFAULT_WORKERS, None
        return await anyio.to_thread.run_sync(disk_probe.auto_workers, path, stride, size)

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def end_requests(self, error: SmoeError) -> None:
        """Stop taking requests and end every one in progress or waiting, after the step in
        progress, with ``error`` (a server's streams then send their error event and end at
        once); the engine's parts stay up until ``aclose``. Idempotent."""
        if self._parts is not None:
            await self._parts.batcher.close(error)

    async def _backbone_checked(self) -> None:
        """Until the backbone's background hash is done; VaultError (every time) if the file
        does not match its checksum: no request gets a token computed with it."""
        if self._backbone_check is not None:
            await asyncio.shield(self._backbone_check)

    async def aclose(self) -> None:
        """Wait for the step in progress, then stop the compute thread, scheduler and I/O
        (the parts' exit stack, smoe.engine.build). Idempotent."""
        if self._backbone_check is not None:  # (its outcome is the requests'; here it ends)
            with contextlib.suppress(Exception):
                await self._backbone_check
        self._opened = False
        try:
            await self._stack.aclose()
        finally:
            # The model and its caches go now, not whenever a user's reference to us does.
            self._parts, self._group = None, None
            if self._plan is not None:  # give the freed buffers back (a GPU's to others)
                import mlx.core as mx

                mx.clear_cache()

    # ---------------------------------------------------------------- parts
    def _open_parts(self) -> EngineParts:
        if self._parts is None:
            raise SmoeError("the engine is not open: use 'async with Engine.open(...) as engine'")
        return self._parts

    @property
    def is_open(self) -> bool:
        """Whether the engine takes requests: opened and not closed since."""
        return self._opened

    @property
    def group(self) -> Group:
        """One process or this rank's share of several (smoe.engine.group): whether it
        speaks to the user, collectives, leading and following. SmoeError if not open."""
        if self._group is None:
            raise SmoeError("the engine is not open: use 'async with Engine.open(...) as engine'")
        return self._group

    @property
    def plan(self) -> Plan:
        """What the engine was planned to be when it opened (device, dtype, context, batch,
        ring and how ``--memory`` divided: ``plan.ring.fit``, host tier); SmoeError before
        it opens."""
        if self._plan is None:
            raise SmoeError("the engine is not open: use 'async with Engine.open(...) as engine'")
        return self._plan

    @property
    def debug(self) -> EngineInternals:
        """The engine's parts, the one door to them (EngineInternals: for the engine's own
        modules, tests and benchmarks; not a stable API). Each part keeps its own thread
        rules."""
        return EngineInternals.of(self._parts, self._tracer)

    @property
    def tokenizer(self) -> Any:
        """The vault's tokenizer, or None where it has none."""
        return self._open_parts().tokenizer

    @property
    def queued(self) -> int:
        """Requests submitted and not yet admitted to the batch (a server's queue)."""
        return self._open_parts().batcher.queued

    def stats(self) -> EngineStats:
        """What the engine is doing now: the scheduler's counters, the ring, the read
        queues, the batch, the compute dtype. Cheap (no device work); call it any time
        after open, from the event loop. SmoeError if not open."""
        dtype = str(self.dtype).split(".")[-1]
        return engine_stats(self._open_parts(), dtype, self._dtype_note, self._arithmetic())

    @functools.cached_property
    def _dtype_note(self) -> str:
        """compute_dtype_note once: it may run a tiny MLX call to test a kernel."""
        from smoe.compute.model import compute_dtype_note

        return compute_dtype_note(self.vault, self.dtype, self.options.dtype is not None)

    @functools.cached_property
    def _native_installed(self) -> bool:
        from smoe.compute.native import NativeLinear, NativeSwitchLinear

        kinds = (NativeLinear, NativeSwitchLinear)
        return any(isinstance(m, kinds) for m in self._open_parts().runner.model.modules())

    def _arithmetic(self) -> str:
        """Whose kernels run the matmuls (smoe.compute.native.arithmetic); which kinds of
        call fell back to MLX's is known as they are first met, so asked each time."""
        import mlx.core as mx

        from smoe.compute.native import arithmetic

        device = mx.gpu if self._plan is not None and self._plan.device.gpu else mx.cpu
        return arithmetic(device, self._native_installed, self.options.cpu_kernels == "mlx")

    # ---------------------------------------------------------------- API
    def _check_prompt(self, tokens: Sequence[int], extra: int = 0) -> list[int]:
        """``tokens`` as a list, or SmoeError if the engine is closed, the prompt is empty,
        an id is outside the vocabulary, or the prompt plus ``extra`` tokens would not fit
        the context."""
        if not self._opened:
            raise SmoeError("the engine is not open: use 'async with Engine.open(...) as engine'")
        vocab = self.vault.manifest.shape.vocab_size
        ids = [int(t) for t in tokens]
        if not ids:
            raise SmoeError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise SmoeError(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")
        if len(ids) + extra > self.max_context:
            raise SmoeError(
                f"{len(ids)} prompt tokens + {extra} to generate exceed the context of "
                f"{self.max_context} tokens; shorten the prompt, lower max_tokens, or open "
                "the engine with a larger max_context (--max-context)"
            )
        return ids

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise SmoeError(f"{self.vault.path} has no tokenizer; pass token ids instead")
        return list(self.tokenizer.encode(text))

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold the engine: no generation step or other compute job starts until the block
        ends (the one in progress finishes first). For work on a sequence's cache outside a
        generation (save, load, fork) and for tests that need the engine still. Cancelling
        the wait for it raises CancelledError and holds nothing; VaultError if the
        backbone's background hash found it damaged."""
        self.group.refuse_while_leading("saving, loading or forking a conversation's cache")
        await self._backbone_checked()  # (what runs inside may compute with the backbone)
        async with self._lock:
            yield

    async def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits, numpy float32 [T, vocab]. No effect on later calls other
        than which experts the ring happens to hold."""
        ids = self._check_prompt(token_ids)
        self.group.refuse_while_leading("teacher-forced logits")
        await self._backbone_checked()
        parts = self._open_parts()
        async with self._lock:
            parts.scheduler.cancel_speculative()  # pre-warm and stale bets give way
            return await parts.compute.run(parts.runner.logits, ids)

    async def generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        stop_at_eos: bool = True,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        logit_bias: dict[int, float] | None = None,
    ) -> AsyncIterator[Event]:
        """Stream tokens; the last event carries ``finish_reason`` and ``stats``.

        ``logprobs`` (0..20): each token's event carries its log-probability and that many
        likeliest alternatives (``Event.logprob``, ``Event.top_logprobs``);
        ``prompt_logprobs`` (0..20): one event before the first token carries the prompt's
        (``Event.prompt_logprobs``; the prompt is then prefilled whole, no cached prefix
        reused). ``logit_bias``: {token id: -100..100} added to the logits before sampling.
        ``max_tokens`` 0 only runs the prompt (its log-probabilities, where asked).
        Raises SmoeError before any work for an empty or too-long prompt or bad settings.
        """
        if max_tokens < 0:
            raise SmoeError("max_tokens must be at least 0 (0: the prompt only)")
        params = SamplingParams(
            temperature,
            top_p,
            top_k,
            min_p,
            repetition_penalty,
            seed=seed,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=tuple((logit_bias or {}).items()),
        )
        params.check()
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        async for event in self.stream(ids, params, max_tokens, stop_at_eos=stop_at_eos):
            yield event

    def stream(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        max_tokens: int,
        *,
        sequence: SequenceHandle | None = None,
        stop_at_eos: bool = True,
        on_prepared: Callable[[Sequence_, int], None] | None = None,
    ) -> AsyncGenerator[Event, None]:
        """Generate from ``prompt`` on ``sequence`` (a handle this engine gave out through
        ``on_prepared``, or None for a new one): the sequence keeps
        the keys and values of the prefix it shares with the prompt, and the batcher
        prefills the rest and decodes it with the others (what conversations and the
        server's prefix reuse build on). ``on_prepared(sequence, tokens_to_prefill)`` runs
        on the compute thread once the sequence points at the prompt. Events as
        ``generate``; leaving the iteration early takes the request out of the batch.
        Raises SmoeError at once for an empty, out-of-vocabulary or too-long prompt, or a
        ``logit_bias`` id outside the vocabulary. ``max_tokens`` 0: the prompt is
        prefilled, its log-probabilities given where ``params`` ask, and the stream ends
        ("length")."""
        ids = self._check_prompt(prompt, extra=max_tokens)
        vocab = self.vault.manifest.shape.vocab_size
        outside = [t for t, _ in params.logit_bias if not 0 <= t < vocab]
        if outside:
            raise SmoeError(f"logit_bias ids {outside[:5]} are outside the vocabulary")
        own = cast(Sequence_ | None, sequence)  # handles are the sequences it made
        eos = self._eos(stop_at_eos)
        params, request = self.group.request(own, ids, params, max_tokens, eos)
        runner, group = self._open_parts().runner, self.group

        def prepare() -> Sequence_:  # compute thread
            seq, run = point(runner, own, ids, params)
            group.adopt(seq, request)
            if on_prepared is not None:
                on_prepared(seq, run)
            return seq

        return self._stream(prepare, len(ids), max_tokens, eos, request)

    async def fork(self, sequence: SequenceHandle) -> SequenceHandle:
        """An independent copy of ``sequence`` (a handle from ``stream``'s
        ``on_prepared``): same tokens and KV cache, decoding apart. Runs on the compute
        thread after the job in progress; hold ``exclusive()`` around it where a generation
        could be using ``sequence``. SmoeError while other ranks follow this one."""
        self.group.refuse_while_leading("copying a sequence")
        parts = self._open_parts()
        own = cast(Sequence_, sequence)
        return cast(SequenceHandle, await parts.compute.run(parts.runner.copy, own))

    def conversation(self, system: str | None = None) -> Conversation:
        """A multi-turn chat that keeps its KV cache between turns (see Conversation)."""
        from smoe.engine.conversation import Conversation

        return Conversation(self, system=system)

    async def load_conversation(self, path: str | Path) -> Conversation:
        """A conversation saved by ``Conversation.save``; SmoeError if unreadable or made
        with another vault."""
        from smoe.engine.conversation import Conversation

        return await Conversation.load(self, path)

    def _eos(self, stop_at_eos: bool) -> frozenset[int]:
        if not stop_at_eos or self.tokenizer is None:
            return frozenset()
        return frozenset(getattr(self.tokenizer, "eos_token_ids", None) or [])

    async def _stream(
        self,
        prepare: Any,
        prompt_len: int,
        max_tokens: int,
        eos: frozenset[int],
        request: Request | None = None,
    ) -> AsyncGenerator[Event, None]:
        """Submit a generation to the batcher and turn its tokens into events. ``prepare``
        runs on the compute thread and returns the sequence pointed at its prompt
        (``Runner.prepare``); the batcher prefills it and decodes it with the others.
        Leaving the iteration early takes the request out of the batch."""
        if not self._opened:
            raise SmoeError("the engine is not open: use 'async with Engine.open(...) as engine'")
        await self._backbone_checked()
        ticket = Ticket(prepare, max_tokens, eos)
        ticket.request = request  # what the other ranks run, when they follow this one
        self._open_parts().batcher.submit(ticket)
        stats = GenerationStats(
            prompt_tokens=prompt_len, compute_dtype=str(self.dtype).split(".")[-1]
        )
        async for event in ticket_events(ticket, self.tokenizer, stats):
            yield event
