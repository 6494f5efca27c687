"""`smoe serve`'s GET /v1/smoe/stats: the scheduler, the ring, the queues, the batch, the
prefix cache and the compute dtype, as JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from smoe.compute.model import compute_dtype_note

if TYPE_CHECKING:
    from smoe.serve.app import Server


async def server_stats(server: Server) -> dict[str, Any]:
    """What /v1/smoe/stats answers (docs/serve.md lists the fields)."""
    sched, batcher = server.engine.scheduler, server.engine.batcher
    # Across ranks: every rank's I/O, gathered at the next iteration (docs/distributed.md).
    ranks = await server.engine.rank_stats() if server.engine.ranks is not None else None
    return {
        **({"ranks": ranks} if ranks is not None else {}),
        "scheduler": sched.stats.to_json(),
        "ring": {"slots": sched.num_slots, "filled": sched.fill()},
        "queues": {
            "demand": sched.queue_depth(0),
            "speculative": sched.queue_depth(1),
            "in_flight": sched.in_flight,
        },
        "batch": {
            "active": len(batcher.active),
            "waiting": batcher.queued,
            "max_batch": batcher.max_batch,
            "steps": batcher.steps,
            "mean_rows_per_step": batcher.step_rows / batcher.steps if batcher.steps else 0.0,
        },
        "prefix_reused_tokens": server.reused_tokens,
        "prefilled_tokens": server.prefilled_tokens,
        # exactness claims hold for a dtype: say which, and why (docs/api.md)
        "compute_dtype": compute_dtype_note(
            server.engine.vault, server.engine.dtype, server.engine.options.dtype is not None
        ),
        "prefix_cache": {
            "sequences": len(server.cache.entries),
            "bytes": server.cache.nbytes(),
            "max_bytes": server.cache.max_bytes,
            "replies": sum(e.reply is not None for e in server.cache.entries),
            "reply_follow_ups": server.reply_follow_ups,
        },
    }
