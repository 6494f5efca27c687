"""Ollama's API in `smoe serve`: POST /api/chat and /api/generate, GET /api/tags,
POST /api/show, GET /api/version.

Requests (``messages`` or ``prompt``/``system``/``raw``, ``tools``, ``options`` with
temperature, top_p, top_k, min_p, num_predict, seed, stop, repeat_penalty and the
penalties) are checked and answered through the server's one pipeline. Ollama streams
unless ``"stream": false``: one JSON object per line (NDJSON), the last with ``done``,
``done_reason`` and the counts and durations (nanoseconds). Tool calls arrive as
``message.tool_calls`` with the arguments as an object; errors are ``{"error": "..."}``.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import anyio
from aiohttp import web

from smoe import __version__
from smoe.serve.api_error import ApiError
from smoe.serve.completion import Format, Usage
from smoe.serve.context import ServeContext
from smoe.serve.intake import off_loop
from smoe.serve.ollama_context import cut, fit_chat, reply_room, request_context
from smoe.serve.spec import (
    INT64,
    JSON_INSTEAD,
    Limits,
    Spec,
    check_stop,
    required,
    validate_fields,
    wrong_type,
)
from smoe.serve.tools import ToolCall
from smoe.serve.validate import check_tools, engine_fields, message_role

__all__ = ["PATH_PREFIX", "OllamaChat", "OllamaGenerate", "error_json", "routes"]

PATH_PREFIX = "/api/"  # the paths whose errors take Ollama's shape


def error_json(e: ApiError) -> dict[str, Any]:
    return {"error": e.message}


ROLES = ("system", "user", "assistant", "tool")


def _check_messages(name: str, value: Any, limits: Limits) -> list[dict[str, Any]]:
    """Ollama's messages as chat-template messages (tool calls' arguments are objects
    already, as templates take them)."""
    if not value:
        raise ApiError(400, f"Invalid '{name}': at least one message is required.", param=name)
    out = []
    for i, message in enumerate(value):
        where = f"{name}[{i}]"
        role = message_role(where, message)
        if message.get("images"):
            raise ApiError(
                400,
                f"Unsupported value: '{where}.images': this server takes text only.",
                param=f"{where}.images",
                code="unsupported_value",
            )
        content = message.get("content") or ""
        if not isinstance(content, str):
            raise wrong_type(f"{where}.content", ("string",), content)
        turn: dict[str, Any] = {"role": role, "content": content}
        calls = message.get("tool_calls")
        if calls and role == "assistant":
            turn["tool_calls"] = [_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
        if role == "tool" and isinstance(message.get("tool_name"), str):
            turn["name"] = message["tool_name"]
        out.append(turn)
    return out


def _call(where: str, call: Any) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise wrong_type(where, ("object",), call)
    function = required(call, where, "function", ("object",))
    arguments = function.get("arguments") or {}
    if not isinstance(arguments, dict):
        raise wrong_type(f"{where}.function.arguments", ("object",), arguments)
    name = required(function, f"{where}.function", "name", ("string",))
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _off(value: Any) -> bool:
    return not value


# fmt: off
OPTIONS: dict[str, Spec] = {
    "temperature": Spec(("number",), lo=0, hi=2),
    "top_p": Spec(("number",), lo=0, hi=1),
    "top_k": Spec(("integer",), lo=0),
    "min_p": Spec(("number",), lo=0, hi=1),
    "num_predict": Spec(("integer",), lo=-2),  # -1 (no limit), -2 (fill the context), 0: default
    "num_ctx": Spec(("integer",), lo=1),  # this request's context (smoe/serve/ollama_context.py)
    "seed": Spec(("integer",), lo=INT64[0], hi=INT64[1]),
    "stop": Spec(("array",), check=lambda n, v, lim: check_stop(n, v, lim, most=16)),
    "repeat_penalty": Spec(("number",), lo=0, lo_open=True),
    "presence_penalty": Spec(("number",), lo=-2, hi=2),
    "frequency_penalty": Spec(("number",), lo=-2, hi=2),
}
UNSUPPORTED = "is not supported by this server"
COMMON: dict[str, Spec] = {
    "model": Spec(("string",)),
    "stream": Spec(("boolean",), default=True),  # Ollama streams unless told not to
    "options": Spec(("object",), default={}),
    "format": Spec(("string", "object"), supported=_off,
                   unsupported=f"{UNSUPPORTED} (no constrained decoding): {JSON_INSTEAD}"),
    "keep_alive": Spec(("number", "string")),  # the model stays loaded: nothing to keep
    "think": Spec(("boolean", "string"), supported=_off, unsupported=UNSUPPORTED),
}
CHAT: dict[str, Spec] = {
    **COMMON,
    "messages": Spec(("array",), required=True, check=_check_messages),
    "tools": Spec(("array",), default=[], check=check_tools),
}
GENERATE: dict[str, Spec] = {
    **COMMON,
    "prompt": Spec(("string",), default=""),
    "system": Spec(("string",), default=""),
    "raw": Spec(("boolean",), default=False),
    "template": Spec(("string",), supported=_off, unsupported=UNSUPPORTED),
    "suffix": Spec(("string",), supported=_off, unsupported=UNSUPPORTED),
    "context": Spec(("array",), supported=_off, unsupported=UNSUPPORTED),
    "images": Spec(("array",), supported=_off, unsupported=UNSUPPORTED),
}
# fmt: on


def _engine_fields(o: dict[str, Any], stream: bool) -> dict[str, Any]:
    """The pipeline's fields from validated ``options``."""
    predict = o["num_predict"]
    return engine_fields(
        max_tokens=predict if predict is not None and predict > 0 else None,
        stop=o["stop"],
        temperature=o["temperature"],
        top_p=o["top_p"],
        top_k=o["top_k"],
        min_p=o["min_p"],
        seed=o["seed"],
        repetition_penalty=o["repeat_penalty"],
        presence_penalty=o["presence_penalty"],
        frequency_penalty=o["frequency_penalty"],
        stream=stream,
    )


def routes(ctx: ServeContext) -> list[web.RouteDef]:
    """Ollama's routes on ``ctx``."""
    engine, pipeline, intake = ctx.engine, ctx.pipeline, ctx.intake
    name = ctx.options.model_name

    def checked(body: dict[str, Any], table: dict[str, Spec]) -> tuple[dict[str, Any], ...]:
        f = validate_fields(body, table, pipeline.limits)
        o = validate_fields(f["options"], OPTIONS, pipeline.limits, prefix="options.")
        return f, o, _engine_fields(o, f["stream"])

    def within(fields: dict[str, Any], o: dict[str, Any], ids: list[int], context: int) -> None:
        default = ctx.options.max_tokens
        reply_room(fields, o["num_predict"], len(ids), context, default)

    async def chat(request: web.Request) -> web.StreamResponse:
        async with intake.preparing(request) as body:
            f, o, fields = await off_loop(checked, body, CHAT)
            context = request_context(o["num_ctx"], engine.max_context)
            if context is None:
                ids, turn = await intake.template(f["messages"], f["tools"])
            else:
                ids, turn = await fit_chat(
                    f["messages"], lambda m: intake.template(m, f["tools"]), context
                )
                within(fields, o, ids, context)
        return await pipeline.answer(
            request, fields, ids, OllamaChat, chat=True, turn=turn, tools=f["tools"]
        )

    async def generate(request: web.Request) -> web.StreamResponse:
        async with intake.preparing(request) as body:
            f, o, fields = await off_loop(checked, body, GENERATE)
            if not f["prompt"]:  # Ollama's way to load a model: answered at once
                return web.json_response({**_head(name), "response": "", **_done("load")})
            if f["raw"]:
                ids = await intake.encode(f["prompt"])
            else:
                system = [{"role": "system", "content": f["system"]}] if f["system"] else []
                user = {"role": "user", "content": f["prompt"]}
                ids, _ = await intake.template([*system, user], [])
            context = request_context(o["num_ctx"], engine.max_context)
            if context is not None:
                ids = cut(ids, context)
                within(fields, o, ids, context)
        return await pipeline.answer(request, fields, ids, OllamaGenerate, chat=False)

    async def tags(request: web.Request) -> web.Response:
        model = await anyio.to_thread.run_sync(_model, ctx)  # stats the vault's files
        return web.json_response({"models": [{"name": name, **model}]})

    async def show_model(request: web.Request) -> web.Response:
        await intake.read_object(request)  # checked; the server has one model
        tok = engine.tokenizer
        template = getattr(tok, "chat_template", None) if tok is not None else None
        tools = tok is not None and bool(getattr(tok, "has_tool_calling", False))
        family = engine.vault.manifest.shape.model_type
        model = await anyio.to_thread.run_sync(_model, ctx)
        return web.json_response(
            {
                "modelfile": "",
                "parameters": "",
                "template": template if isinstance(template, str) else "",
                "details": model["details"],
                "model_info": {
                    "general.architecture": family,
                    "general.context_length": engine.max_context,
                },
                "capabilities": ["completion", *(["tools"] if tools else [])],
                "modified_at": model["modified_at"],
            }
        )

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def running(request: web.Request) -> web.Response:
        """Ollama's /api/ps: the model in memory (one, loaded for good), and its memory:
        the backbone and the ring (a GPU's, as VRAM, where the ring is device memory)."""
        model = await anyio.to_thread.run_sync(_model, ctx)
        fit = engine.plan.ring.fit
        size = fit.total if fit is not None else engine.stats().ring.nbytes
        return web.json_response(
            {
                "models": [
                    {
                        "name": name,
                        "model": name,
                        "size": size,
                        "digest": "",
                        "details": model["details"],
                        "expires_at": "0001-01-01T00:00:00Z",  # never unloaded
                        "size_vram": size if engine.plan.device.gpu else 0,
                        "context_length": engine.max_context,
                    }
                ]
            }
        )

    return [
        web.post("/api/chat", chat),
        web.post("/api/generate", generate),
        web.get("/api/tags", tags),
        web.post("/api/show", show_model),
        web.get("/api/version", version),
        web.get("/api/ps", running),
    ]


def _model(ctx: ServeContext) -> dict[str, Any]:
    """/api/tags's entry for the vault: its files' size and the manifest's time (worker
    thread: it stats the files)."""
    vault = ctx.engine.vault
    files = [p for p in vault.path.iterdir() if p.is_file()]
    newest = max((p.stat().st_mtime for p in files), default=0.0)
    family = vault.manifest.shape.model_type
    return {
        "model": ctx.options.model_name,
        "modified_at": datetime.fromtimestamp(newest, UTC).isoformat().replace("+00:00", "Z"),
        "size": sum(p.stat().st_size for p in files),
        "details": {
            "parent_model": "",
            "format": "smoe",
            "family": family,
            "families": [family],
            "parameter_size": "",
            "quantization_level": "",
        },
    }


def _head(model: str) -> dict[str, Any]:
    now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
    return {"model": model, "created_at": now}


def _done(reason: str, usage: Usage | None = None) -> dict[str, Any]:
    """The last object's fields: why it ended, the counts and durations (ns)."""
    done: dict[str, Any] = {"done": True, "done_reason": reason}
    if usage is not None:
        done |= {
            "total_duration": int(usage.total_s * 1e9),
            "load_duration": 0,  # the model stays loaded
            "prompt_eval_count": usage.prompt,
            "prompt_eval_duration": int(usage.first_token_s * 1e9),
            "eval_count": usage.completion,
            "eval_duration": int(max(0.0, usage.total_s - usage.first_token_s) * 1e9),
        }
    return done


def _line(data: dict[str, Any]) -> bytes:
    return json.dumps(data).encode() + b"\n"


class OllamaChat(Format):
    """/api/chat's answer: ``message`` objects, one per line when streaming."""

    stream_type = "application/x-ndjson"

    def _object(self, content: str, calls: list[ToolCall], done: dict[str, Any]) -> bytes:
        return _line({**_head(self.out.model), **self._part(content, calls), **done})

    def _part(self, content: str, calls: list[ToolCall]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [
                {"function": {"name": c.name, "arguments": c.arguments}} for c in calls
            ]
        return {"message": message}

    def body(self, usage: Usage) -> dict[str, Any]:
        out = self.out
        return {
            **_head(out.model),
            **self._part(out.reply, out.calls),
            **_done(out.finish, usage),
        }

    def text(self, piece: str) -> list[bytes]:
        return [self._object(piece, [], {"done": False})]

    def calls(self, calls: list[ToolCall]) -> list[bytes]:
        return [self._object("", calls, {"done": False})]

    def closing(self, usage: Usage) -> list[bytes]:
        return [self._object("", [], _done(self.out.finish, usage))]

    def failure(self, error: ApiError) -> list[bytes]:
        return [_line(error_json(error))]


class OllamaGenerate(OllamaChat):
    """/api/generate's answer: ``response`` text (a generate request has no tools)."""

    def _part(self, content: str, calls: list[ToolCall]) -> dict[str, Any]:
        return {"response": content}
