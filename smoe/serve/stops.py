"""Stop strings for streamed text (OpenAI's ``stop``)."""

from __future__ import annotations


class StopMatcher:
    """Cuts streamed text at the first stop string. A tail that could be the start of one is
    held back until the next piece shows whether it is, so no stop string is ever sent and
    other text is never delayed."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> str:
        """Add ``text``; return what may be sent now (all of it before a stop string)."""
        if self.stopped:
            return ""
        self.pending += text
        hits = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits)
            out, self.pending, self.stopped = self.pending[:at], "", True
            return out
        cut = len(self.pending) - self._held()
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def _held(self) -> int:
        """Length of the longest tail of the pending text that begins a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(stop[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """The held-back rest, once the text has ended without a stop string."""
        out, self.pending = self.pending, ""
        return out
