"""Whether `smoe serve` can serve, as /health reports it: the last failure that was the
server's (a 503: its vault or disk), until a request succeeds again. Event loop only."""

from __future__ import annotations

from smoe.serve.api_error import ApiError, failure

__all__ = ["Health"]


class Health:
    """The server's own failures, remembered for /health."""

    def __init__(self) -> None:
        # Why the last request that failed for the server's sake failed, until one succeeds
        self.failing: str | None = None

    def failure(self, e: Exception, rid: str) -> ApiError:
        """``failure(e, rid)`` (smoe/serve/api_error.py), remembered when it is the
        server's (a 503). Logs as ``failure`` does; never raises."""
        err = failure(e, rid)
        if err.status == 503:
            # the class only: /health needs no key, the details stay in the server log
            self.failing = f"the last request failed: {type(e).__name__} (see the server log)"
        return err

    def served(self) -> None:
        """A generation went through: the engine serves again."""
        self.failing = None
