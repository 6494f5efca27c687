"""What the engine hands its callers to hold and give back, as opaque as they need it.

``SequenceHandle``: a generation's state (its KV cache on the compute thread) as the
server's prefix cache keeps it. A caller reads its tokens and size and passes it back to
the engine; only the engine's compute thread touches what is inside (``Sequence_``)."""

from __future__ import annotations

from typing import Protocol


class SequenceHandle(Protocol):
    @property
    def tokens(self) -> list[int]:
        """The stream: prompt(s) and replies."""

    @property
    def cached(self) -> int:
        """Leading tokens whose keys and values the cache holds."""

    def kv_bytes(self) -> int:
        """Bytes its KV cache holds."""
