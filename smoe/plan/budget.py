"""One memory budget for the whole process: backbone + KV caches + working memory + ring.

Pure arithmetic over the model's config.json and its backbone's safetensors header (no
MLX, no weights read), shared by the engine and ``smoe plan`` through ``smoe.plan.plan``; every
formula is in docs/plan.md. Sizes are bytes; ``dsize`` is the compute dtype's item size
(4: float32 on the CPU, 2: bfloat16 on a GPU).

- backbone: each float tensor in the dtype the engine keeps it in (the compute dtype, or
  its own where stored wider: smoe.models.dtypes), packed ones as stored; equal to the
  loaded arrays' nbytes (tests/unit/test_budget.py).
- KV: mlx-lm's caches for ``sequences`` sequences at ``context`` tokens: per attention
  layer K and V of [kv_heads, capacity, head_dim] (DeepSeek's MLA: what its mlx-lm file
  caches, ``kv_elements``), capacity the context rounded up to the cache's 256-token step;
  quantized (``kv_bits`` 8 or 4, mlx-lm's QuantizedKVCache): bits/8 bytes per element
  plus a scale and a bias in the compute dtype per group (``kv_group_size``).
- working: the Python + MLX + mlx-lm runtime (measured, ``RUNTIME_BYTES``), a prefill
  chunk's activations and attention scores, the logits of a batch, one layer's KV growing
  (mlx-lm concatenates the old cache with a new step), all times MLX's buffer cache
  (``ALLOCATOR_SLACK``: freed buffers are kept for the next pass; the engine caps MLX's
  cache at what this counts, ``allocator_cache_bytes``); and what a layer-major
  prefill pass holds across its chunks (``pass_bytes`` for ``pass_tokens``: the context,
  at most 4,096 tokens).
- ring: what remains, in whole slots, at most every expert, at least one layer's top-k.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from smoe.errors import SmoeError
from smoe.models.dtypes import FLOAT_SIZES, SAFETENSORS_FLOATS, FloatPolicy
from smoe.util.sizes import as_written, format_bytes, round_size, slots_for_budget

# Resident set of a process that imported MLX, mlx-lm and the tokenizers and opened an
# engine, less the backbone and ring it loaded: 289 MB measured on x86-64 Linux, Python
# 3.11, MLX 0.32.4 (the demo vault, peak RSS; docs/plan.md). Rounded up by 10%.
RUNTIME_BYTES = 320 * 10**6
ALLOCATOR_SLACK = 2.0  # MLX keeps the previous pass's freed buffers for reuse
KV_STEP = 256  # mlx-lm's KVCache / QuantizedKVCache grow in steps of 256 tokens
KV_BITS = (4, 8)  # quantized KV cache widths (mlx-lm's QuantizedKVCache): the one list

_SAFETENSORS_SIZES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


def backbone_bytes(header: dict[str, Any], policy: FloatPolicy) -> int:
    """Bytes the backbone's tensors take once loaded: each float one in the dtype
    ``policy`` keeps it in (the compute dtype, or its own where stored wider), the rest
    (packed weights) as stored. ``header`` is the backbone's safetensors header
    (smoe.models.checkpoint.safetensors_header)."""
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = entry["dtype"], entry["shape"]
        if dtype not in _SAFETENSORS_SIZES:
            raise SmoeError(f"backbone tensor {name} has dtype {dtype} S-MoE cannot size")
        count = math.prod(int(n) for n in shape)
        stored = SAFETENSORS_FLOATS.get(dtype)
        item = (
            _SAFETENSORS_SIZES[dtype] if stored is None else FLOAT_SIZES[policy.kept(name, stored)]
        )
        total += count * item
    return total


def kv_elements(config: dict[str, Any]) -> int:
    """K and V elements one token adds to one layer's mlx-lm cache: 2 x kv_heads x
    head_dim; DeepSeek-V2's MLA caches keys of nope+rope and values of v_head_dim per head,
    DeepSeek-V3's its compressed latent and one rope key (their mlx-lm files)."""
    heads = int(config.get("num_attention_heads", 1))
    if config.get("kv_lora_rank"):
        rope = int(config.get("qk_rope_head_dim") or 0)
        if config.get("model_type") in ("deepseek_v3", "kimi_k2"):
            return int(config["kv_lora_rank"]) + rope
        nope, v = int(config.get("qk_nope_head_dim") or 0), int(config.get("v_head_dim") or 0)
        return heads * (nope + rope + v)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return 2 * kv_heads * _head_dim(config)


def _head_dim(config: dict[str, Any]) -> int:
    heads = int(config.get("num_attention_heads", 1))
    return int(config.get("head_dim") or int(config.get("hidden_size", 0)) // max(1, heads))


def kv_group_size(config: dict[str, Any]) -> int:
    """The group a quantized KV cache rounds keys and values in: mlx-lm's 64 where the
    heads' width allows, else 32 (e.g. heads of 32); SmoeError where neither divides it."""
    if config.get("kv_lora_rank"):  # MLA (DeepSeek): its cached widths are 64-multiples
        return 64
    width = _head_dim(config)
    for group in (64, 32):
        if width % group == 0:
            return group
    raise _unquantizable(width)


def _unquantizable(width: int) -> SmoeError:
    return SmoeError(
        f"--kv-bits needs attention heads whose width is a multiple of 32; this model's "
        f"are {width} wide: leave --kv-bits out"
    )


@dataclass(frozen=True)
class Attention:
    """What the KV cache and the attention scores need of a config.json."""

    layers: int  # layers with a KV cache
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    intermediate: int  # the widest MLP a token runs (dense, or top_k x expert width)
    max_context: int  # the model's max_position_embeddings (4096 if unstated)
    kv_width: int = 0  # K+V elements per token and layer (kv_elements; 0: 2 x kv_heads x head_dim)
    kv_group: int = 64  # a quantized cache's group (kv_group_size; 0: cannot be quantized)
    top_k: int = 1  # experts per token (1: a dense model)

    @property
    def kv_per_token(self) -> int:
        return self.kv_width or 2 * self.kv_heads * self.head_dim

    @classmethod
    def of(cls, config: dict[str, Any]) -> Attention:
        heads = int(config.get("num_attention_heads", 1))
        top_k = int(config.get("num_experts_per_tok") or 1)
        expert = int(config.get("moe_intermediate_size") or 0) * top_k
        try:
            group = kv_group_size(config)
        except SmoeError:
            group = 0
        return cls(
            layers=int(config.get("num_hidden_layers", 1)),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=_head_dim(config),
            hidden=int(config.get("hidden_size", 0)),
            vocab=int(config.get("vocab_size", 0)),
            intermediate=max(int(config.get("intermediate_size") or 0), expert),
            top_k=top_k,
            max_context=int(config.get("max_position_embeddings") or 4096),
            kv_width=kv_elements(config),
            kv_group=group,
        )


# The context budgeted when none is asked for (llama.cpp's and ollama's default too): the
# KV caches of the model's maximum (often 32-128K tokens) would take most budgets.
DEFAULT_CONTEXT = 4096
SMALLEST_DEFAULT_CONTEXT = 512  # the default shrinks to fit --memory, not below this


def default_contexts(model_max: int) -> list[int]:
    """The contexts tried, in order, when none is asked for: DEFAULT_CONTEXT (or the
    model's maximum if smaller), then halves down to SMALLEST_DEFAULT_CONTEXT, so a
    budget that cannot hold the default gets the largest of them that fits."""
    first = min(DEFAULT_CONTEXT, model_max)
    out = [first]
    while out[-1] // 2 >= SMALLEST_DEFAULT_CONTEXT:
        out.append(out[-1] // 2)
    return out


def pick_context(
    asked: int | None, model_max: int, fits: Callable[[int], bool]
) -> tuple[int, bool]:
    """The context to budget the KV caches for, and whether it is the default: ``asked``
    (at most the model's maximum), else the first of ``default_contexts`` that ``fits``,
    else the last of them (whose refusal names the smallest budget that works)."""
    if asked is not None:
        return min(asked, model_max), False
    options = default_contexts(model_max)
    return next((c for c in options if fits(c)), options[-1]), True


def smallest_context(asked: int | None, model_max: int) -> int:
    """The least context the run accepts (where the smallest budget is named): ``asked``
    (at most the model's maximum), else the last of ``default_contexts``."""
    return min(asked, model_max) if asked is not None else default_contexts(model_max)[-1]


def kv_capacity(context: int) -> int:
    """Tokens an mlx-lm cache holding ``context`` tokens has allocated (256-token steps)."""
    return -(-max(context, 1) // KV_STEP) * KV_STEP


def kv_bytes(
    attn: Attention, dsize: int, context: int, sequences: int = 1, kv_bits: int | None = None
) -> int:
    """Bytes of ``sequences`` mlx-lm KV caches holding ``context`` tokens each: K and V per
    layer, in the compute dtype, or quantized to ``kv_bits`` with a scale and a bias in the
    compute dtype per ``attn.kv_group`` elements."""
    if kv_bits is not None and kv_bits not in KV_BITS:
        raise SmoeError(f"kv_bits must be 4 or 8 (or left out), not {kv_bits}")
    elements = attn.layers * attn.kv_per_token * kv_capacity(context)
    if kv_bits is None:
        per_sequence = elements * dsize
    else:
        if not attn.kv_group:
            raise _unquantizable(attn.head_dim)
        per_sequence = elements * kv_bits // 8 + 2 * (elements // attn.kv_group) * dsize
    return sequences * per_sequence


# The most prompt tokens one layer-major prefill pass holds (smoe.compute.prompt_pass): a
# longer prompt runs in passes of this many, each reading a layer's experts once.
PASS_TOKENS = 4096


def pass_tokens(context: int, chunk: int) -> int:
    """Prompt tokens one layer-major pass holds: the context (a prompt fills at most all
    but one of it), at most PASS_TOKENS, rounded up to whole chunks."""
    return max(chunk, -(-min(context, PASS_TOKENS) // chunk) * chunk)


def pass_bytes(attn: Attention, dsize: int, tokens: int) -> int:
    """What a layer-major pass over ``tokens`` prompt tokens holds at once beside one
    chunk's activations: each token's residual stream, its normed input at the MoE layer
    and its top-k expert outputs (kept until the layer's last wave) [T, (2 + k), D]."""
    return tokens * (2 + attn.top_k) * attn.hidden * dsize


def transient_bytes(attn: Attention, dsize: int, chunk: int, context: int, batch: int) -> int:
    """What a pass allocates and frees again: a chunk's activations and attention scores,
    a batch's logits, one layer's KV growing (module docstring)."""
    # [chunk, hidden] residual stream, norms, q/k/v/o and the MLP's gate/up/act for a chunk
    activations = chunk * (8 * attn.hidden + 3 * attn.intermediate) * dsize
    scores = 2 * attn.heads * chunk * kv_capacity(context) * 4  # float32 scores + softmax
    logits = 2 * batch * attn.vocab * 4  # float32 logits and their log-softmax
    growth = kv_bytes(attn, dsize, context) // max(1, attn.layers)  # one layer's concatenate
    return activations + scores + logits + growth


def allocator_cache_bytes(attn: Attention, dsize: int, chunk: int, context: int, batch: int) -> int:
    """The freed buffers working memory counts MLX's cache keeping for the next pass:
    (ALLOCATOR_SLACK - 1) x ``transient_bytes``. Under a budget the engine caps MLX's
    buffer cache at this (smoe.util.allocator.limit_mlx_cache; MLX's own default on the
    CPU is 32 MB, whatever the budget counted)."""
    return int((ALLOCATOR_SLACK - 1) * transient_bytes(attn, dsize, chunk, context, batch))


def working_bytes(attn: Attention, dsize: int, chunk: int, context: int, batch: int) -> int:
    """Working memory beside the backbone, KV and ring (module docstring)."""
    transient = transient_bytes(attn, dsize, chunk, context, batch)
    cache = allocator_cache_bytes(attn, dsize, chunk, context, batch)
    prompt = pass_bytes(attn, dsize, pass_tokens(context, chunk))  # a layer-major prefill
    return RUNTIME_BYTES + transient + cache + prompt


@dataclass(frozen=True)
class BudgetParts:
    """The budget's parts beside the ring (bytes), for one model, device and options."""

    backbone: int
    kv: int
    working: int
    context: int  # tokens the KV caches are budgeted for
    sequences: int
    kv_bits: int | None
    cache: int = 0  # MLX's buffer cache, in working (allocator_cache_bytes)

    @property
    def fixed(self) -> int:
        return self.backbone + self.kv + self.working


def budget_parts_for(
    config: dict[str, Any],
    backbone: int,
    dsize: int,
    *,
    context: int | None = None,
    sequences: int = 1,
    kv_bits: int | None = None,
    prefill_chunk: int = 64,
    landing: int = 0,
    device_memory: bool = False,
) -> BudgetParts:
    """Backbone (its in-memory bytes, ``backbone_bytes``), KV for ``sequences`` sequences
    at ``context`` tokens (None or beyond the model's: the model's max), and working
    memory, plus ``landing`` bytes of host buffers (a staged ring's). ``device_memory``: a
    discrete GPU's budget, which the host's runtime is not in."""
    attn = Attention.of(config)
    context = min(context or attn.max_context, attn.max_context)
    working = working_bytes(attn, dsize, prefill_chunk, context, sequences) + landing
    if device_memory:
        working -= RUNTIME_BYTES
    kv = kv_bytes(attn, dsize, context, sequences, kv_bits)
    cache = allocator_cache_bytes(attn, dsize, prefill_chunk, context, sequences)
    return BudgetParts(backbone, kv, working, context, sequences, kv_bits, cache)


@dataclass(frozen=True)
class Fit:
    """How a whole-process budget divides (bytes)."""

    total: int  # the budget
    backbone: int
    kv: int
    working: int  # runtime + activations (+ a staged ring's host landing buffers)
    slot_bytes: int
    slots: int  # the ring, in experts
    num_records: int  # every expert of the model
    context: int
    sequences: int
    kv_bits: int | None
    default_context: bool = False  # the context was not asked for (default_contexts)
    cache: int = 0  # MLX's buffer cache, in working: the engine caps MLX's at it
    min_slots: int = 0  # the fewest slots a ring may have: one layer's top-k

    @property
    def fixed(self) -> int:
        return self.backbone + self.kv + self.working

    @property
    def ring(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def fits(self) -> bool:
        """Whether the budget holds the rest and at least ``min_slots`` slots."""
        return self.slots >= self.min_slots

    @property
    def smallest(self) -> int:
        """The least budget that fits at this context: the rest and ``min_slots`` slots."""
        return self.fixed + self.min_slots * self.slot_bytes

    def refusal(self) -> str:
        """Why the budget does not fit, naming the smallest that works and the options that
        shrink the rest (what BudgetTooSmall says; ``smoe plan``'s "why")."""
        return (
            f"a memory budget of {as_written(self.total)} cannot hold backbone "
            f"{format_bytes(self.backbone)} + KV {format_bytes(self.kv)} ({self.sequences} x "
            f"{self.context} context) + working {format_bytes(self.working)} + "
            f"{self.min_slots} expert slots of {format_bytes(self.slot_bytes)}: the smallest "
            f"that works is --memory {round_size(self.smallest)} (or shrink the KV cache: "
            "--max-context, --kv-bits)"
        )

    def line(self) -> str:
        """'memory 8.00 GB: backbone 2.10 GB + KV 0.50 GB (4096 context, 8-bit) + working
        0.60 GB -> ring 4.80 GB = 310 experts x 15.48 MB (5.2%)': x the slot's size, the
        figure `smoe inspect` and `smoe plan` print for the vault."""
        bits = "model dtype" if self.kv_bits is None else f"{self.kv_bits}-bit"
        seqs = f"{self.sequences} x " if self.sequences > 1 else ""
        return (
            f"memory {format_bytes(self.total)}: backbone {format_bytes(self.backbone)} + KV "
            f"{format_bytes(self.kv)} ({seqs}{self.context} context"
            f"{' by default, --max-context for more' if self.default_context else ''}, {bits}) "
            "+ working "
            f"{format_bytes(self.working)} -> ring {format_bytes(self.ring)} = {self.slots} "
            f"experts x {format_bytes(self.slot_bytes)} "
            f"({100 * self.slots / self.num_records:.1f}%)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "memory_bytes": self.total,
            "backbone_bytes": self.backbone,
            "kv_bytes": self.kv,
            "working_bytes": self.working,
            "ring_bytes": self.ring,
            "ring_slots": self.slots,
            "slot_bytes": self.slot_bytes,
            "ring_share_of_experts": round(self.slots / self.num_records, 4),
            "context": self.context,
            "sequences": self.sequences,
            "kv_bits": self.kv_bits,
            "allocator_cache_bytes": self.cache,
        }


def fit(
    memory: int, needs: BudgetParts, *, slot_bytes: int, min_slots: int, num_records: int
) -> Fit:
    """How a budget of ``memory`` bytes divides: ``needs`` beside a ring of what remains, in
    whole slots (smoe.util.sizes.slots_for_budget), at most every expert. Never raises: a
    budget below ``min_slots`` slots (one layer's top-k) gives a Fit that does not fit
    (``Fit.fits``), whose ``refusal`` names the smallest budget that works."""
    slots = slots_for_budget(memory - needs.fixed, slot_bytes, max_slots=num_records)
    return Fit(
        memory,
        needs.backbone,
        needs.kv,
        needs.working,
        slot_bytes,
        slots,
        num_records,
        needs.context,
        needs.sequences,
        needs.kv_bits,
        cache=needs.cache,
        min_slots=min_slots,
    )
