"""A `smoe serve` running in the test's event loop, for the server tests."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from smoe.engine import Engine
from smoe.serve.app import Server, ServerOptions, serve


class Running:
    """``async with Running(engine, options) as srv``: a server on a free port of
    127.0.0.1 (``srv.base``), cancelled on exit; ``server``, if given, is the Server it
    runs (a test can look into it); ``srv.client()`` makes an OpenAI client closed on exit."""

    def __init__(self, engine: Engine, options: ServerOptions, server: Server | None = None):
        self.engine, self.options, self.server = engine, options, server
        self.clients: list[Any] = []

    async def __aenter__(self) -> Running:
        loop = asyncio.get_running_loop()
        port = loop.create_future()
        self.task = loop.create_task(
            serve(
                self.engine, "127.0.0.1", 0, self.options, ready=port.set_result, server=self.server
            )
        )
        self.port = await port
        self.base = f"http://127.0.0.1:{self.port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        # Close the clients on this loop: left to the garbage collector, their connections
        # close later on a closed loop and log errors into another test.
        for c in self.clients:
            await c.close()
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task

    def client(self, key: str = "secret") -> Any:
        import openai

        c = openai.AsyncOpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0)
        self.clients.append(c)
        return c

    def anthropic(self, key: str = "secret") -> Any:
        """An Anthropic client of this server (it sends the key as ``x-api-key``)."""
        import anthropic

        c = anthropic.AsyncAnthropic(base_url=self.base, api_key=key, max_retries=0)
        self.clients.append(c)
        return c

    def ollama(self, **headers: str) -> Any:
        """An Ollama client of this server."""
        import ollama

        c = ollama.AsyncClient(host=self.base, headers=headers)
        self.clients.append(c)
        return c
