"""The async API on the event loop: open a vault, get logits, generate, converse.

    async with smoe.Engine.open("vault", memory="6GB") as engine:
        logits = await engine.logits([1, 2, 3])           # numpy float32 [T, vocab]
        async for event in engine.generate("Hello", max_tokens=32):
            print(event.text, end="")

- ``core``: the Engine, its lifecycle and the generation API;
- ``options``: EngineOptions, checked before any resource is taken;
- ``events``: what a generation yields (Event, GenerationStats);
- ``batcher``: continuous batching of the active generations (no MLX);
- ``conversation``: multi-turn chats that keep their KV cache between turns.
"""

from smoe.engine.core import Engine
from smoe.engine.events import Event, GenerationStats
from smoe.plan.options import EngineOptions

__all__ = ["Engine", "EngineOptions", "Event", "GenerationStats"]
