"""One request's way out of the batcher: its ticket's events become the ``Event``s the
caller reads (tokens detokenised as they come: ``TextStream``), ending with the request's
statistics.

Cancellation: leaving the iteration early (``aclose``, a cancelled consumer) cancels the
ticket, which leaves the batch at the batcher's next iteration. A ``Failed`` event is
raised to the consumer as the error it carries.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from typing import Any

from smoe.compute.sequence import cache_nbytes
from smoe.engine.batcher import End, Failed, Prompt, Ticket
from smoe.engine.events import Event, GenerationStats


async def ticket_events(
    ticket: Ticket, tokenizer: Any, stats: GenerationStats
) -> AsyncIterator[Event]:
    """Events of ``ticket``: one per token (its text as far as it decodes), a last one with
    the finish reason and ``stats`` filled in (``request_stats``). ``tokenizer``: mlx-lm's
    TokenizerWrapper, or None (token ids only)."""
    detok = TextStream(tokenizer) if tokenizer is not None else None
    t_first: float | None = None
    finish = "length"
    ending: Event = Event()  # the EOS id's numbers, where asked (on the last event)
    try:
        while True:
            event = await ticket.events.get()
            if isinstance(event, Failed):
                raise event.error
            if isinstance(event, End):
                finish = event.reason
                break
            if isinstance(event, Prompt):
                yield Event(prompt_logprobs=event.scores)
                continue
            value = event.id
            now = time.perf_counter()
            if t_first is None:
                t_first = now
            stats.generated_tokens += 1
            if value in ticket.eos:
                if event.score is not None:
                    ending = _token_event(value, "", event.score)
                continue  # the end follows
            text = detok.add(value) if detok is not None else ""
            yield _token_event(value, text, event.score)
    finally:
        ticket.cancel()
    if detok is not None and (rest := detok.finish()):
        yield Event(text=rest)
    yield Event(
        finish_reason=finish,
        stats=request_stats(ticket, stats, t_first),
        end_token=ending.token,
        logprob=ending.logprob,
        top_logprobs=ending.top_logprobs,
    )


class TextStream:
    """The text of a stream of token ids, piece by piece: the pieces join to exactly
    ``tokenizer.decode(ids)`` (mlx-lm's streaming detokenizers drop a first token's
    leading space, which OpenAI's, vLLM's and llama.cpp's completions keep).

    Each new id is decoded in a window with the id before it (vLLM's way), so what a
    decoder does to a text's first token (SentencePiece drops its space) touches only
    that context id. Text that later ids may still change waits: an unfinished UTF-8
    character, a run of byte-fallback ids (``<0xE6>``: decoded as one run), and where the
    tokenizer cleans up spaces (" ," to ","), a trailing space."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.start = 0  # the window: ids[start:] are decoded together
        self.given = 0  # characters of the window's text already given out
        self.hold_space = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))

    def _decode(self, start: int) -> str:
        text = self.tokenizer.decode(self.ids[start:])
        return text if isinstance(text, str) else ""

    def add(self, token: int) -> str:
        """Take one id; return the text it completes ('' while it waits)."""
        self.ids.append(token)
        if _byte_fallback(self.tokenizer, token):
            return ""  # its run's text comes with the next other id (or ``finish``)
        text = self._decode(self.start)
        ready = text.rstrip("\ufffd")
        if self.hold_space:
            ready = ready.rstrip(" ")
        piece = ready[self.given :]
        self.given = max(self.given, len(ready))
        if len(ready) == len(text) and len(self.ids) - self.start > 1:
            # all given out: the window restarts at this id, when its own text is whole
            alone = self._decode(len(self.ids) - 1)
            if alone and "\ufffd" not in alone:
                self.start, self.given = len(self.ids) - 1, len(alone)
        return piece

    def finish(self) -> str:
        """The text still held back once the ids have ended."""
        return self._decode(self.start)[self.given :] if self.ids else ""


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _byte_fallback(tokenizer: Any, token: int) -> bool:
    """Whether ``token`` is a byte-fallback id (SentencePiece's ``<0xE6>``)."""
    name = tokenizer.convert_ids_to_tokens(token)
    return isinstance(name, str) and _BYTE_TOKEN.fullmatch(name) is not None


def _token_event(token: int, text: str, score: Any) -> Event:
    """A token's event, with its log-probability where the request asked (``score``)."""
    if score is None:
        return Event(token=token, text=text)
    return Event(token=token, text=text, logprob=score.logprob, top_logprobs=score.top)


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
