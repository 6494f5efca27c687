"""One request's way out of the batcher: its ticket's events become the ``Event``s the
caller reads (tokens detokenised as they come), ending with the request's statistics.

Cancellation: leaving the iteration early (``aclose``, a cancelled consumer) cancels the
ticket, which leaves the batch at the batcher's next iteration. A ``Failed`` event is
raised to the consumer as the error it carries.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from smoe.compute.runner import cache_nbytes
from smoe.engine.batcher import End, Failed, Ticket
from smoe.engine.events import Event, GenerationStats


async def ticket_events(
    ticket: Ticket, tokenizer: Any, stats: GenerationStats
) -> AsyncIterator[Event]:
    """Events of ``ticket``: one per token (its text as far as it decodes), a last one with
    the finish reason and ``stats`` filled in (``request_stats``). ``tokenizer``: mlx-lm's
    TokenizerWrapper, or None (token ids only)."""
    detok = tokenizer.detokenizer if tokenizer is not None else None
    if detok is not None:
        detok.reset()
    t_first: float | None = None
    finish = "length"
    try:
        while True:
            event = await ticket.events.get()
            if isinstance(event, Failed):
                raise event.error
            if isinstance(event, End):
                finish = event.reason
                break
            value = event.id
            now = time.perf_counter()
            if t_first is None:
                t_first = now
            stats.generated_tokens += 1
            if value in ticket.eos:
                continue  # the end follows
            text = ""
            if detok is not None:
                detok.add_token(value)
                text = detok.last_segment
            yield Event(token=value, text=text)
    finally:
        ticket.cancel()
    if detok is not None:
        detok.finalize()
        if detok.last_segment:
            yield Event(text=detok.last_segment)
    yield Event(finish_reason=finish, stats=request_stats(ticket, stats, t_first))


def request_stats(ticket: Ticket, stats: GenerationStats, t_first: float | None) -> GenerationStats:
    """What one request took. Its I/O counts its own prefill chunks, and of each decode
    step it shared with others its share of the bytes (hit rates: the step's)."""
    end = time.perf_counter()
    pre, dec = ticket.prefill, ticket.decode
    stats.prefilled_tokens = ticket.prompt_run
    stats.prefill_unique_experts = pre.experts
    stats.prefill_bytes = pre.bytes_read
    if t_first is not None:
        stats.ttft_s = t_first - ticket.submitted
        stats.prefill_tok_s = max(stats.prefilled_tokens, 1) / max(stats.ttft_s, 1e-9)
    decoded = stats.generated_tokens - 1
    if t_first is not None and decoded > 0:
        span = max(end - t_first, 1e-9)
        stats.decode_tok_s = decoded / span
        stats.decode_bytes_per_token = dec.bytes_read / decoded
        stats.decode_bus_bytes_per_token = dec.bus_bytes / decoded
        stats.decode_io_wait_share = min(1.0, dec.wait_s / span)
        stats.decode_copy_share = min(1.0, dec.copy_s / span)
        asked = dec.hits + dec.misses
        stats.decode_hit_rate = dec.hits / asked if asked else 0.0
    if ticket.batch_sizes:
        stats.decode_batch_mean = sum(ticket.batch_sizes) / len(ticket.batch_sizes)
    stats.bytes_read = pre.bytes_read + dec.bytes_read
    stats.bus_bytes = pre.bus_bytes + dec.bus_bytes
    if ticket.seq is not None:  # (sizes only: no MLX array is read or evaluated)
        stats.kv_cache_bytes = cache_nbytes(ticket.seq)
    stats.hits, stats.misses = pre.hits + dec.hits, pre.misses + dec.misses
    asked = stats.hits + stats.misses
    stats.hit_rate = stats.hits / asked if asked else 0.0
    return stats
