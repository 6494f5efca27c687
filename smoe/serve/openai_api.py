"""OpenAI's API in `smoe serve`: POST /v1/chat/completions and /v1/completions, GET
/v1/models; and OpenAI's error shape, which every path no other API claims answers in.

The request side is smoe/serve/validate.py's ``FIELDS``; the answers are
smoe/serve/openai_format.py's (one choice), or smoe/serve/choices.py's (``n`` > 1, a list
of prompts). Errors are ``{"error": {message, type, param, code}}`` (``ApiError.to_json``).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from smoe.serve import choices
from smoe.serve.api_error import ApiError
from smoe.serve.context import ServeContext
from smoe.serve.intake import off_loop
from smoe.serve.openai_format import OpenAIFormat
from smoe.serve.stats import model_created
from smoe.serve.validate import validate_request

__all__ = ["PATH_PREFIX", "error_json", "routes"]

# Every path: OpenAI's error shape is the server's own (the longest prefix wins)
PATH_PREFIX = "/"


def error_json(e: ApiError) -> dict[str, Any]:
    return e.to_json()


def routes(ctx: ServeContext) -> list[web.RouteDef]:
    """OpenAI's routes on ``ctx``."""
    pipeline, intake = ctx.pipeline, ctx.intake

    async def chat(request: web.Request) -> web.StreamResponse:
        async with intake.preparing(request) as body:
            fields = await off_loop(validate_request, body, "chat", pipeline.limits)
            tools = fields["tools"] if fields["tool_choice"] != "none" else []
            ids, turn = await intake.template(fields["messages"], tools)
        if fields["n"] > 1:  # several choices (smoe/serve/choices.py)
            return await choices.answer(pipeline, request, fields, [ids], True, tools=tools)
        return await pipeline.answer(
            request, fields, ids, OpenAIFormat, chat=True, turn=turn, tools=tools
        )

    async def completions(request: web.Request) -> web.StreamResponse:
        async with intake.preparing(request) as body:
            fields = await off_loop(validate_request, body, "completions", pipeline.limits)
            prompts = fields["prompt"]  # one or more (smoe/serve/choices.py)
            ids = [await intake.encode(p) if isinstance(p, str) else p for p in prompts]
            echoes = await choices.echo_texts(ctx.engine.tokenizer, fields, prompts)
        if len(ids) > 1 or fields["n"] > 1:
            return await choices.answer(pipeline, request, fields, ids, False, echoes)
        return await pipeline.answer(
            request, fields, ids[0], OpenAIFormat, chat=False, echo=echoes[0]
        )

    async def models(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": ctx.options.model_name,
                        "object": "model",
                        "created": model_created(ctx.engine.vault),
                        "owned_by": "smoe",
                    }
                ],
            }
        )

    return [
        web.get("/v1/models", models),
        web.post("/v1/chat/completions", chat),
        web.post("/v1/completions", completions),
    ]
