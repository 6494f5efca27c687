"""The async API on the event loop: open a vault, get logits, generate, converse.

    async with smoe.Engine.open("vault", memory="6GB") as engine:
        logits = await engine.logits([1, 2, 3])           # numpy float32 [T, vocab]
        async for event in engine.generate("Hello", max_tokens=32):
            print(event.text, end="")

- ``core``: the Engine, its lifecycle and the generation API (EngineOptions lives in
  smoe.plan.options, checked before any resource is taken);
- ``build``: the parts opened in order on one exit stack (``EngineParts``);
- ``group``: one process or this rank's share of several, chosen once (``Engine.group``);
  ``ranks`` and ``mirror``: the ranks' collectives, and rank 0's requests run on each;
- ``learning``: pre-warm, load-all, warm-up and the routing archive (``Engine.learning``);
- ``batcher``: continuous batching of the active generations (no MLX); ``requests``:
  a ticket's events turned into ``Event``s; ``events``: Event, GenerationStats;
- ``stats``: ``Engine.stats()`` and ``Engine.debug`` (the one door to the parts);
- ``conversation`` and ``conversation_file``: multi-turn chats that keep their KV cache,
  and their files; ``prefix_store``: a server's long prompts kept on disk;
- ``tokenizer``, ``handles``: the vault's tokenizer; what callers hold and give back.
"""

from smoe.engine.core import Engine
from smoe.engine.events import Event, GenerationStats
from smoe.plan.options import EngineOptions

__all__ = ["Engine", "EngineOptions", "Event", "GenerationStats"]
