"""What one request's task carries from the middleware to the code that answers it: its
id (quoted in 5xx answers and log lines), the tokens it generated (for its access line)
and whether its client went away (its access line says 499).

The middleware sets the context variables in the request's task before the handler runs
(smoe/serve/middleware.py); the handler runs in that same task, so it sees them.
"""

from __future__ import annotations

import contextvars

from aiohttp import web

__all__ = ["DROPPED", "GENERATED", "REQUEST_ID", "count_generated"]

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
# The tokens the request in this task generated, one entry per generation
GENERATED: contextvars.ContextVar[list[int]] = contextvars.ContextVar("smoe_generated")
# Set on a request whose client went away: its access line says 499
DROPPED = web.RequestKey("smoe_dropped", bool)


def count_generated(tokens: int) -> None:
    """Add ``tokens`` to this request's access line (nothing outside a request's task)."""
    GENERATED.get([]).append(tokens)
