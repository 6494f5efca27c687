"""How values a client sent are named in `smoe serve`'s error messages: their JSON type
in words ("an integer", "a string") and a short rendering safe to echo back.

``BadNumber`` lives here too: it is what the body parser (smoe/serve/body.py) makes of
NaN, Infinity and floats beyond 64 bits, and these messages name it as sent.
"""

from __future__ import annotations

import json
from typing import Any


class BadNumber:
    """What the parser makes of NaN, Infinity and floats beyond 64 bits; reported with
    the field it sits in once parsing is done."""

    def __init__(self, literal: str) -> None:
        self.literal = literal

    def __repr__(self) -> str:
        return self.literal


NOUNS = {
    "integer": "an integer",
    "number": "a number",
    "boolean": "a boolean",
    "string": "a string",
    "array": "an array",
    "object": "an object",
}


def noun(value: Any) -> str:
    """``value``'s JSON type in words: "an integer", "a non-finite number"."""
    kind = json_type(value)
    return NOUNS.get(kind, "a " + kind)


def json_type(value: Any) -> str:
    """``value``'s JSON type ("integer", "number", "string", ...) as parsed from a body."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, BadNumber):
        return "non-finite number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def is_int(value: Any) -> bool:
    """A JSON integer (a bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def show(value: Any, limit: int = 40) -> str:
    """A short rendering of what the client sent, safe to echo."""
    if is_int(value) and abs(value) >= 10**limit:  # str() of 4300+ digits raises
        return f"an integer of about {int(abs(value).bit_length() * 0.30103) + 1} digits"
    text = json.dumps(value) if not isinstance(value, BadNumber) else value.literal
    return text if len(text) <= limit else text[: limit - 3] + "..."
