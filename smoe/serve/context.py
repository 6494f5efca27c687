"""What an API dialect of `smoe serve` is given, and what the server knows of one.

The server (smoe/serve/app.py) builds one ``ServeContext`` and hands it to each dialect's
``routes``; a dialect never sees the server itself. Each dialect module (openai_api.py,
anthropic_api.py, ollama_api.py) is a ``Dialect``: its routes, its error shape, and the
paths whose errors take that shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from smoe.engine import Engine
from smoe.serve.api_error import ApiError
from smoe.serve.options import ServerOptions
from smoe.serve.pipeline import Pipeline
from smoe.serve.prompt import Intake

__all__ = ["Dialect", "ServeContext"]


@dataclass(frozen=True)
class ServeContext:
    """A dialect's handle on the server: the engine (to read, e.g. its tokenizer and
    context), the server's settings, ``intake`` (a request into a prompt:
    smoe/serve/prompt.py) and ``pipeline`` (a prompt into an answer, its counts and the
    prefix cache: smoe/serve/pipeline.py). Event loop only."""

    engine: Engine
    options: ServerOptions
    intake: Intake
    pipeline: Pipeline


class Dialect(Protocol):
    """An API as the server knows it (a module: openai_api, anthropic_api, ollama_api)."""

    # The paths whose errors take this API's shape: those that begin with it (of several
    # that do, the longest wins)
    PATH_PREFIX: str

    def routes(self, ctx: ServeContext) -> list[web.RouteDef]:
        """The API's routes, answering through ``ctx``."""
        ...

    def error_json(self, e: ApiError) -> dict[str, Any]:
        """``e`` in the API's error shape."""
        ...
