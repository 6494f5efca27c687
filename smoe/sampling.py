"""How the next token is chosen: ``SamplingParams``, checked once, shared by the engine,
the compute thread and the servers. No MLX here: the surfaces import it without the
model code (the samplers themselves are mlx-lm's, built in smoe.compute.runner)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingParams:
    """How the next token is chosen (mlx-lm's samplers; temperature 0 = greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context: int = 20
    seed: int | None = None
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from seen tokens' logits
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence

    def check(self) -> None:
        import math

        from smoe.errors import SmoeError

        numbers = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }
        for name, value in numbers.items():  # NaN passes every comparison below
            if not math.isfinite(value):
                raise SmoeError(f"{name} must be a finite number, not {value}")
        if self.temperature < 0:
            raise SmoeError("temperature must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise SmoeError("top_p must be in (0, 1]")
        if self.top_k < 0 or not 0 <= self.min_p < 1:
            raise SmoeError("top_k must be >= 0 and min_p in [0, 1)")
        if self.repetition_penalty <= 0:
            raise SmoeError("repetition_penalty must be > 0 (1 is off)")
        if not (-2 <= self.presence_penalty <= 2 and -2 <= self.frequency_penalty <= 2):
            raise SmoeError("presence_penalty and frequency_penalty must be in [-2, 2]")
