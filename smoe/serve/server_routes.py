"""`smoe serve`'s own endpoints, beside the APIs': GET / (that it runs, and where the APIs
are), /health (whether it can serve; needs no key), /metrics (Prometheus:
smoe/serve/metrics.py) and /v1/smoe/stats (the engine's and the prefix cache's numbers:
smoe/serve/stats.py)."""

from __future__ import annotations

from aiohttp import web

from smoe.serve.context import ServeContext
from smoe.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from smoe.serve.metrics import render as render_metrics
from smoe.serve.stats import server_stats

__all__ = ["routes"]


def routes(ctx: ServeContext) -> list[web.RouteDef]:
    """The server's own routes on ``ctx``."""
    engine, options, pipeline = ctx.engine, ctx.options, ctx.pipeline

    async def root(request: web.Request) -> web.Response:
        """What a browser or `curl URL` sees: that it runs, which model, where the APIs are."""
        return web.json_response(
            {
                "status": "S-MoE is running",
                "model": options.model_name,
                "apis": {"openai": "/v1", "anthropic": "/v1/messages", "ollama": "/api"},
                "stats": "/v1/smoe/stats",
                "metrics": "/metrics",
            }
        )

    async def health(request: web.Request) -> web.Response:
        """200 when the engine can take requests, else 503 with why: the engine closed, or
        the last request failed for the server's sake (its vault or disk) and none has
        succeeded since. Needs no key."""
        why = "the engine is closed" if not engine.is_open else pipeline.health.failing
        if why is not None:
            return web.json_response({"status": "unavailable", "why": why}, status=503)
        batch = engine.stats().batch
        return web.json_response(
            {
                "status": "ok",
                "model": options.model_name,
                "active": batch.active,
                "waiting": batch.waiting,
                "max_batch": batch.max_batch,
                "max_queue": options.max_queue,
            }
        )

    async def metrics(request: web.Request) -> web.Response:
        body = render_metrics(engine, pipeline.counts)
        return web.Response(text=body, headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(await server_stats(pipeline))

    return [
        web.get("/", root),
        web.get("/health", health),
        web.get("/metrics", metrics),
        web.get("/v1/smoe/stats", stats),
    ]
