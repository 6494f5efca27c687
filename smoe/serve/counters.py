"""What `smoe serve` counts while it runs, for /metrics and /v1/smoe/stats: requests by
status, and the tokens of their prompts and replies. Event loop only."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

__all__ = ["ServerCounts"]


@dataclass
class ServerCounts:
    """What /metrics counts: requests answered by status, and their tokens; and how the
    prefix cache served them (/v1/smoe/stats)."""

    by_status: collections.Counter[int] = field(default_factory=collections.Counter)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose keys and values were reused
    prefilled_tokens: int = 0  # prompt tokens run (all but each prompt's last)
    reply_follow_ups: int = 0  # chat requests that continued a cached reply's ids

    def prepared(self, prompt: int, run: int) -> None:
        """A prompt of ``prompt`` tokens will prefill ``run`` of them: the rest but its
        last (which runs in the first step) came from a cached prefix."""
        self.reused_tokens += prompt - 1 - run
        self.prefilled_tokens += run
