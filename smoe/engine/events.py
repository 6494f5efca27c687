"""What a generation yields: ``Event`` per token (and a last one with ``stats``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smoe.sampling import TokenLogprob


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prefilled_tokens: int = 0  # prompt tokens actually run (a follow-up turn reuses the rest)
    generated_tokens: int = 0
    ttft_s: float = 0.0  # request to first token
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    bytes_read: int = 0
    hits: int = 0
    misses: int = 0
    hit_rate: float = 0.0
    decode_hit_rate: float = 0.0  # experts found in the ring during decode steps
    prefill_unique_experts: int = 0  # sum over (chunk, layer) of distinct experts
    prefill_bytes: int = 0
    decode_bytes_per_token: float = 0.0
    bus_bytes: int = 0  # copied up from the host tier instead of read (smoe.io.host_tier)
    decode_bus_bytes_per_token: float = 0.0
    decode_io_wait_share: float = 0.0  # of decode time, spent waiting for expert reads
    decode_copy_share: float = 0.0  # of decode time, copying landed reads into slots (staged)
    decode_batch_mean: float = 0.0  # sequences per decode step (1: it ran alone)
    kv_cache_bytes: int = 0  # the sequence's KV cache at the end (allocated; see --kv-bits)
    compute_dtype: str = ""  # e.g. "float32": equal to mlx-lm's run in this same dtype

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Event:
    """One token (``token``, ``text``), or the end (``finish_reason`` and ``stats``).

    Where the request asked (``SamplingParams.logprobs``), a token comes with its
    log-probability (``logprob``) and the likeliest tokens at its place (``top_logprobs``:
    (id, log-probability) pairs, likeliest first); an EOS id that ended the generation
    has no event of its own: the last event names it (``end_token``) with its numbers.
    Where the request asked for the prompt's (``prompt_logprobs``), one event before the
    first token carries them: a TokenLogprob per prompt token after the first. None where
    not asked."""

    token: int | None = None
    text: str = ""
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stats: GenerationStats | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    end_token: int | None = None  # the EOS id that ended it, where numbers were asked
