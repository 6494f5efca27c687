"""`smoe serve`'s settings: what `smoe serve`'s flags set, with the defaults a library
caller gets (``ServerOptions``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from smoe.engine.prefix_store import MIN_TOKENS
from smoe.serve.body import MAX_BODY_BYTES
from smoe.serve.guard import Guard
from smoe.serve.intake import REQUEST_MEMORY

__all__ = ["ServerOptions"]


@dataclass
class ServerOptions:
    api_key: str | None = None  # compared in constant time (smoe/serve/guard.py)
    # Host and Origin rules (smoe/serve/guard.py); None: the bind address's defaults
    guard: Guard | None = None
    max_queue: int = 16  # requests waiting for a place in the batch; more get 429
    model_name: str = "smoe"
    cached_sequences: int = 8  # KV caches kept for prefix reuse
    cached_bytes: int = 2 * 1024**3  # and at most this much of their keys and values
    # Long prompts' KV caches on disk, kept across restarts (smoe/engine/prefix_store.py)
    prefix_dir: Path | None = None
    prefix_dir_bytes: int = 8 * 1024**3
    prefix_min_tokens: int = MIN_TOKENS
    prewarm_when_idle: bool = True  # read the hottest experts into empty slots when idle
    max_body_bytes: int = MAX_BODY_BYTES  # larger request bodies get 413
    # Bodies arriving and requests being prepared hold at most this (smoe/serve/intake.py)
    request_memory: int = REQUEST_MEMORY
    body_timeout_s: float = 60.0  # a body slower than this gets 408 (a stalled client)
    # What a request that does not say gets (`smoe serve --temp/--top-p/--max-tokens`,
    # else the model's generation_config; greedy as mlx_lm.server without either).
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 256  # at most what the context has room for
    # Stopping: end the engine's requests in flight (each stream sends an error event),
    # then wait at most shutdown_s for the handlers to finish writing.
    end_requests_on_stop: bool = True
    shutdown_s: float = 10.0
    # A socket idle this long (nothing sent yet, or between requests) is closed; past
    # max_connections open at once a new one gets 503 and is closed (smoe/serve/listener.py).
    idle_timeout_s: float = 30.0
    max_connections: int = 128  # each holds up to intake.CONNECTION_BYTES, in the plan
