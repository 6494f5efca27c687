"""`smoe serve`'s GET /v1/smoe/stats: the engine's stats (``Engine.stats()``: scheduler,
ring, queues, batch, compute dtype) and the server's prefix cache, as JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from smoe.serve.app import Server


async def server_stats(server: Server) -> dict[str, Any]:
    """What /v1/smoe/stats answers (docs/serve.md lists the fields)."""
    now = server.engine.stats()
    # Across ranks: every rank's I/O, gathered at the next iteration (docs/distributed.md).
    ranks = await server.engine.rank_stats() if server.engine.ranks is not None else None
    return {
        **({"ranks": ranks} if ranks is not None else {}),
        "scheduler": now.scheduler.to_json(),
        "ring": {"slots": now.ring.slots, "filled": now.ring.filled},
        "queues": now.queues.__dict__.copy(),
        "batch": now.batch.__dict__.copy(),
        "prefix_reused_tokens": server.reused_tokens,
        "prefilled_tokens": server.prefilled_tokens,
        # exactness claims hold for a dtype: say which, and why (docs/api.md)
        "compute_dtype": now.compute_dtype_note,
        "arithmetic": now.arithmetic,  # whose kernels (smoe.compute.native)
        "prefix_cache": {
            "sequences": len(server.cache.entries),
            "bytes": server.cache.nbytes(),
            "max_bytes": server.cache.max_bytes,
            "replies": sum(e.reply is not None for e in server.cache.entries),
            "reply_follow_ups": server.reply_follow_ups,
        },
        # on disk (--prefix-cache-dir), null without one
        "prefix_store": server.store.stats() if server.store is not None else None,
    }
