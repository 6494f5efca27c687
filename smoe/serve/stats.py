"""`smoe serve`'s GET /v1/smoe/stats: the engine's stats (``Engine.stats()``: scheduler,
ring, queues, batch, compute dtype) and the server's prefix cache, as JSON."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from smoe.serve.pipeline import Pipeline


async def server_stats(pipeline: Pipeline) -> dict[str, Any]:
    """What /v1/smoe/stats answers (docs/serve.md lists the fields): ``pipeline``'s
    engine, counts and prefix cache now. Raises what ``Engine.group.rank_stats`` raises across
    ranks (a rank gone)."""
    engine, counts, cache, store = pipeline.engine, pipeline.counts, pipeline.cache, pipeline.store
    now = engine.stats()
    # Across ranks: every rank's I/O, gathered at the next iteration (docs/distributed.md).
    ranks = await engine.group.rank_stats() if engine.group.distributed else None
    return {
        **({"ranks": ranks} if ranks is not None else {}),
        # hits: the scheduler's and the resident tables' (a whole model in the ring asks
        # the scheduler nothing), as a request's own hit rate counts them
        "scheduler": now.scheduler.to_json()
        | {"hits": now.hits, "resident_hits": now.resident_hits, "hit_rate": now.hit_rate},
        "ring": {"slots": now.ring.slots, "filled": now.ring.filled},
        "queues": now.queues.__dict__.copy(),
        "batch": now.batch.__dict__.copy(),
        "prefix_reused_tokens": counts.reused_tokens,
        "prefilled_tokens": counts.prefilled_tokens,
        # exactness claims hold for a dtype: say which, and why (docs/api.md)
        "compute_dtype": now.compute_dtype_note,
        "arithmetic": now.arithmetic,  # whose kernels (smoe.compute.native)
        "prefix_cache": {
            "sequences": len(cache.entries),
            "bytes": cache.nbytes(),
            "max_bytes": cache.max_bytes,
            "replies": sum(e.reply is not None for e in cache.entries),
            "reply_follow_ups": counts.reply_follow_ups,
        },
        # on disk (--prefix-cache-dir), null without one
        "prefix_store": store.stats() if store is not None else None,
    }


def model_created(vault: Any) -> int:
    """When the served model was made, in Unix seconds (/v1/models' ``created``: OpenAI's
    clients take it for a timestamp): the vault manifest's time, else its directory's."""
    try:
        return int(datetime.fromisoformat(vault.manifest.created).timestamp())
    except (AttributeError, TypeError, ValueError):
        pass
    try:
        return int(vault.path.stat().st_mtime)
    except (AttributeError, OSError):
        return int(time.time())
