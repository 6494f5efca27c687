"""``EngineOptions``: every knob of an engine, checked before the engine starts anything."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from smoe.compute.draft import DRAFTERS, MAX_DRAFT_TOKENS
from smoe.errors import SmoeError
from smoe.parallel import BACKENDS as DISTRIBUTED_BACKENDS
from smoe.plan.budget import KV_BITS  # quantized KV cache widths offered (one list)
from smoe.sched.hints import default_hint_depth, split_policy_name, takes_hints
from smoe.sched.policy import POLICIES
from smoe.util.sizes import parse_size

if TYPE_CHECKING:
    import argparse

MAX_WORKERS = 256  # I/O threads: far past what any disk rewards (--workers auto picks <= 16)
CPU_KERNELS = ("auto", "mlx")  # smoe.compute.native's, where they run; or MLX's own
MAX_READ_PARTS = 64  # parts a record is read in at once, each a thread's read

# The options `smoe generate`, `chat` and `serve` take as flags of the same name
# (smoe.commands.engine_flags), which ``EngineOptions.from_args`` reads.
FLAG_OPTIONS = (
    "memory",
    "host_memory",
    "slots",
    "workers",
    "dtype",
    "prefill_chunk",
    "max_context",
    "kv_bits",
    "device",
    "ring",
    "policy",
    "hint_depth",
    "spec",
    "lookahead",
    "distributed",
    "collective_timeout",
    "draft",
    "draft_tokens",
    "cpu_kernels",
)


@dataclass(frozen=True)
class EngineOptions:
    """Every knob of an engine, frozen: checked once when made (``__post_init__``: what
    needs no model) and against the model when the engine opens (``check``). A bad value
    raises SmoeError naming the fix, before any resource is taken."""

    # memory and host_memory: sizes in bytes, or text such as "6GB" (the Python API's
    # edge), made bytes once when made: read them as ``memory_bytes``/``host_memory_bytes``.
    memory: int | str | None = None  # the whole process's budget, e.g. "6GB": backbone + KV
    # caches + working memory + the ring, which gets what remains (smoe.plan.budget); None:
    # all experts if they fit, else what does (smoe.plan.ring: the GPU's free memory, or half the
    # available memory beside the backbone)
    slots: int | None = None  # explicit ring size (wins over memory)
    # The host tier beside a GPU's ring (smoe.plan.host_tier): "64GB", 0 for none; None:
    # half the host's available memory where the ring is a discrete GPU's, else none.
    host_memory: int | str | None = None
    # I/O threads; None: chosen for the disk when the engine opens (smoe.io.disk_probe.
    # auto_workers: a short probe per disk, cached; 4 for a model under 1 GiB)
    workers: int | None = None
    read_parts: int | None = None  # parts a record is read in at once (None: one per 2 MB, <= 4)
    dtype: str | None = None  # compute dtype; None: float32 on CPU, bfloat16 on GPU
    prefill_chunk: int = 64
    max_context: int | None = None  # None: the model's max_position_embeddings
    kv_bits: int | None = None  # quantized KV cache (mlx-lm): 4 or 8 bits; None: model dtype
    policy: str = "lfu"  # decayed LFU: fewest misses in docs/cache-policy.md; a "+hint"
    # suffix (lru+hint, lfu+hint, lru-layer+hint) feeds it the router's near misses
    hint_depth: int | None = None  # +hint: gate ranks top_k..hint_depth-1 (None: 4 x top_k)
    spec: int = 0  # gate-echo bets per layer and decode step (docs/speculation.md)
    lookahead: bool = True  # next layer's router on this layer's input (docs/speculation.md)
    direct_io: bool = True
    # generations decoded together (1: one at a time); None: 8 (smoe.plan.ring)
    max_batch: int | None = None
    # Shape batched and verify passes so each row gets its solo bits (smoe.compute.
    # solo_rows): None: where kernels need it (a GPU); True: also on the CPU (tests);
    # False: never (to measure what it costs; a GPU batch may then change tokens).
    solo_rows: bool | None = None
    device: str | None = None  # "cpu" or "gpu"; None: MLX's default
    ring: str = "auto"  # "unified", "staged" or "auto" (smoe.plan.ring)
    bank_bytes: int | None = None  # staged ring: bytes per array (None: the device's limit)
    # Expert parallelism over mx.distributed (docs/distributed.md): the backend to join the
    # ranks with ("any", "ring", "mpi", "nccl", "jaccl"); None: this process alone.
    distributed: str | None = None
    collective_timeout: float = 120.0  # seconds a sum over ranks may wait before giving up
    # Prompt-lookup drafts verified in one pass (docs/draft.md): "ngram" or None (off);
    # draft_tokens: tokens drafted per pass (k).
    draft: str | None = None
    draft_tokens: int = 4
    # The CPU's matmuls: "auto" (S-MoE's kernels, MLX's bits, where they run:
    # smoe.compute.native) or "mlx" (MLX's own kernels, one core each).
    cpu_kernels: str = "auto"
    # Host bytes the caller keeps beside the engine, counted in working memory: `smoe
    # serve`'s connections and requests (smoe.serve.intake.serve_reserve).
    host_reserve: int = 0

    def __post_init__(self) -> None:
        """The sizes made bytes, and the checks that need no model (SmoeError naming the
        fix: a size that cannot be read among them)."""
        for name in ("memory", "host_memory"):  # frozen: set once, here
            value = getattr(self, name)
            object.__setattr__(self, name, None if value is None else parse_size(value))
        if self.prefill_chunk < 1:
            raise SmoeError("prefill_chunk must be at least 1")
        if self.host_reserve < 0:
            raise SmoeError("host_reserve must be at least 0 bytes")
        if self.cpu_kernels not in CPU_KERNELS:
            raise SmoeError(f"cpu_kernels must be auto or mlx, not {self.cpu_kernels!r}")
        if self.max_batch is not None and self.max_batch < 1:
            raise SmoeError("max_batch must be at least 1 (1 decodes one request at a time)")
        if self.workers is not None and not 1 <= self.workers <= MAX_WORKERS:
            raise SmoeError(f"workers must lie in 1..{MAX_WORKERS} (one I/O thread each)")
        if self.read_parts is not None and not 1 <= self.read_parts <= MAX_READ_PARTS:
            raise SmoeError(
                f"read_parts must lie in 1..{MAX_READ_PARTS} (1 reads each record whole)"
            )
        if self.max_context is not None and self.max_context < 2:
            raise SmoeError("max_context must be at least 2 tokens (a prompt and a reply)")
        if self.kv_bits is not None and self.kv_bits not in KV_BITS:
            raise SmoeError(f"kv_bits must be 4 or 8 (or left out), not {self.kv_bits}")
        if self.dtype is not None and self.dtype not in ("float32", "bfloat16", "float16"):
            raise SmoeError(
                f"dtype {self.dtype} is not supported; use float32, bfloat16 or float16"
            )
        if self.device is not None and self.device not in ("cpu", "gpu"):
            raise SmoeError(f"device must be cpu or gpu, not {self.device!r}")
        if self.ring not in ("auto", "unified", "staged"):
            raise SmoeError(f"ring must be auto, unified or staged, not {self.ring!r}")
        if self.distributed is not None and self.distributed not in DISTRIBUTED_BACKENDS:
            raise SmoeError(
                f"unknown distributed backend {self.distributed!r}; use one of "
                f"{', '.join(DISTRIBUTED_BACKENDS)}"
            )
        if not self.collective_timeout > 0:
            raise SmoeError("collective_timeout must be positive (seconds)")
        self._check_draft()
        base, hinted = split_policy_name(self.policy)
        if base not in POLICIES:
            names = ", ".join(sorted(POLICIES))
            raise SmoeError(f"unknown policy {self.policy!r}; choose one of {names}")
        if hinted and not takes_hints(POLICIES[base]):
            raise SmoeError(f"policy '{base}' takes no hints; use lru, lfu or lru-layer")
        if not hinted and self.hint_depth is not None:
            raise SmoeError(f"hint_depth needs a '+hint' policy, not '{self.policy}'")

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineOptions:
        """The options the run commands' flags give (``FLAG_OPTIONS``, parsed once by
        argparse: sizes are bytes), with ``overrides`` (a command's own: generate's
        ``max_batch=1``, serve's ``host_reserve``). SmoeError as for any EngineOptions."""
        return cls(**({name: getattr(args, name) for name in FLAG_OPTIONS} | overrides))

    @property
    def memory_bytes(self) -> int | None:
        """The whole process's budget in bytes (None: the default's)."""
        assert not isinstance(self.memory, str)  # (made bytes by __post_init__)
        return self.memory

    @property
    def host_memory_bytes(self) -> int | None:
        """The host tier's bytes (None: the default's; 0: none)."""
        assert not isinstance(self.host_memory, str)  # (made bytes by __post_init__)
        return self.host_memory

    def check(self, top_k: int, num_experts: int) -> None:
        """Refuse any option that cannot work with a model routing ``top_k`` of
        ``num_experts`` experts per layer (SmoeError naming the fix), before the engine
        takes a resource: no file, thread or ring is left behind by a bad option."""
        if not 0 <= self.spec <= num_experts - top_k:
            raise SmoeError(
                f"spec (gate-echo bets) must lie in 0..{num_experts - top_k} for a model "
                f"routing {top_k} of {num_experts} experts"
            )
        _, hinted = split_policy_name(self.policy)
        if hinted and not top_k < self.hint_depth_for(top_k, num_experts) <= num_experts:
            raise SmoeError(f"hint_depth must lie in {top_k + 1}..{num_experts}")

    def _check_draft(self) -> None:
        if self.draft is not None and self.draft not in DRAFTERS:
            raise SmoeError(f"unknown draft {self.draft!r}; use {', '.join(DRAFTERS)}")
        if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise SmoeError(f"draft_tokens must lie in 1..{MAX_DRAFT_TOKENS}")
        if self.draft is not None and self.distributed is not None:
            raise SmoeError("--draft is not supported with --distributed; drop one of them")

    def hint_depth_for(self, top_k: int, num_experts: int) -> int:
        """The gate ranks a '+hint' policy is fed: hint_depth, else 4 x top_k."""
        if self.hint_depth is not None:
            return self.hint_depth
        return default_hint_depth(top_k, num_experts)
