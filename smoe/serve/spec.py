"""How `smoe serve` checks a request's fields: a table of ``Spec`` (each field's JSON
type, range and what this server supports) run over the parsed body by
``validate_fields``, and the checks the tables share (stop strings, text, required keys).

Every API's table uses it: OpenAI's (smoe/serve/validate.py), Anthropic's and Ollama's
(smoe/serve/anthropic_api.py, ollama_api.py). Every problem raises ``ApiError``: a 400 in
OpenAI's error shape whose one-line message names the field, what is allowed and what
was sent, e.g. ``Invalid 'temperature': expected a number between 0 and 2, but got 5
instead.`` Pure functions of the body: they run on a worker thread (smoe/serve/intake.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from smoe.serve.api_error import ApiError
from smoe.serve.describe import NOUNS, json_type, noun, show

MAX_STOP_CHARS = 1000  # each stop string; the matcher's work per token grows with it
INT64 = (-(2**63), 2**63 - 1)

# What to do instead of JSON mode, which would need constrained decoding (docs/serve.md)
JSON_INSTEAD = (
    "give a tool whose parameters are the JSON schema (its call's arguments come back as "
    "a JSON object), or ask for the JSON in the prompt"
)


@dataclass(frozen=True)
class Limits:
    """What depends on the model: the vocabulary and the most tokens a reply may have."""

    vocab: int
    max_tokens: int


@dataclass(frozen=True)
class Spec:
    """One request field. ``kinds``: the JSON types allowed (null always means "not
    sent"); ``lo``/``hi``: the range of a number (``lo_open``: lo itself excluded;
    ``hi`` "max_tokens" means the model's limit); ``supported``: the values this server
    implements, ``unsupported`` saying why others are refused; ``check``: more checks,
    returning the value to use; ``only``: the endpoint ("chat", "completions") or both."""

    kinds: tuple[str, ...]
    default: Any = None
    lo: float | None = None
    hi: float | str | None = None
    lo_open: bool = False
    supported: Callable[[Any], bool] | None = None
    unsupported: str = ""
    check: Callable[[str, Any, Limits], Any] | None = None
    required: bool = False
    only: str | None = None


def validate_fields(
    body: dict[str, Any], table: dict[str, Spec], limits: Limits, prefix: str = ""
) -> dict[str, Any]:
    """Every field of ``table`` in ``body`` checked and converted (numbers to float), or
    its default; fields not in the table are ignored. ApiError 400 names the first bad
    field as ``prefix + name``."""
    return {
        name: _validate(prefix + name, body.get(name), spec, limits) for name, spec in table.items()
    }


def _validate(name: str, value: Any, spec: Spec, limits: Limits) -> Any:
    if value is None:
        if spec.required:
            raise ApiError(
                400,
                f"Missing required parameter: '{name}'.",
                param=name,
                code="missing_required_parameter",
            )
        return spec.default
    kind = json_type(value)
    if kind not in spec.kinds and not ("number" in spec.kinds and kind == "integer"):
        raise wrong_type(name, spec.kinds, value)
    if spec.lo is not None or spec.hi is not None:
        _check_range(name, value, spec, limits)
    if spec.supported is not None and not spec.supported(value):
        raise ApiError(
            400,
            f"Unsupported value: '{name}' {spec.unsupported}; got {show(value)}.",
            param=name,
            code="unsupported_value",
        )
    if spec.check is not None:
        return spec.check(name, value, limits)
    if spec.kinds != ("number",):
        return value
    try:
        return float(value)
    except OverflowError:  # an integer beyond float64, in a field with no upper bound
        raise ApiError(
            400,
            f"Invalid '{name}': expected {expected(spec)} that fits a 64-bit float, "
            f"but got {show(value)} instead.",
            param=name,
            code="decimal_above_max_value",
        ) from None


def _check_range(name: str, value: float, spec: Spec, limits: Limits) -> None:
    lo, hi = spec.lo, limits.max_tokens if spec.hi == "max_tokens" else spec.hi
    assert not isinstance(hi, str)
    below = lo is not None and (value <= lo if spec.lo_open else value < lo)
    above = hi is not None and value > hi
    if below or above:
        number = "integer" if spec.kinds == ("integer",) else "decimal"
        raise ApiError(
            400,
            f"Invalid '{name}': expected {expected(spec, hi)}, but got {show(value)} instead.",
            param=name,
            code=f"{number}_{'below_min' if below else 'above_max'}_value",
        )


def expected(spec: Spec | None, hi: float | str | None = None) -> str:
    """``spec``'s values in words: "a number between 0 and 2" ("a value" for no spec)."""
    if spec is None:
        return "a value"
    hi = spec.hi if hi is None else hi
    kinds = " or ".join(NOUNS[k] for k in spec.kinds)
    lo, hi = spec.lo, None if isinstance(hi, str) else hi
    if lo is None:
        return kinds if hi is None else f"{kinds} of at most {_num(hi)}"
    if hi is None:
        return f"{kinds} {'above' if spec.lo_open else 'of at least'} {_num(lo)}"
    if spec.lo_open:
        return f"{kinds} above {_num(lo)} and at most {_num(hi)}"
    return f"{kinds} between {_num(lo)} and {_num(hi)}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def wrong_type(where: str, kinds: tuple[str, ...], value: Any) -> ApiError:
    """The 400 for a value of the wrong JSON type at ``where``."""
    return ApiError(
        400,
        f"Invalid type for '{where}': expected {' or '.join(NOUNS[k] for k in kinds)}, "
        f"but got {noun(value)} instead.",
        param=where,
        code="invalid_type",
    )


def required(obj: dict[str, Any], where: str, key: str, kinds: tuple[str, ...]) -> Any:
    """``obj[key]``, which must be there and of one of ``kinds``; ApiError 400 if not."""
    value = obj.get(key)
    if value is None:
        raise ApiError(
            400,
            f"Missing required parameter: '{where}.{key}'.",
            param=f"{where}.{key}",
            code="missing_required_parameter",
        )
    if json_type(value) not in kinds and not ("number" in kinds and _is_number(value)):
        raise wrong_type(f"{where}.{key}", kinds, value)
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_stop(name: str, value: Any, limits: Limits, most: int = 16) -> list[str]:
    """Stop strings: one string or an array of up to ``most``, each 1 to 1000 characters."""
    stops = [value] if isinstance(value, str) else value
    if len(stops) > most:
        raise ApiError(
            400,
            f"Invalid '{name}': expected a string or an array of up to {most} strings, "
            f"but got {len(stops)} strings instead.",
            param=name,
            code="array_above_max_length",
        )
    for i, stop in enumerate(stops):
        where = name if isinstance(value, str) else f"{name}[{i}]"
        if not isinstance(stop, str):
            raise wrong_type(where, ("string",), stop)
        if not 1 <= len(stop) <= MAX_STOP_CHARS:
            raise ApiError(
                400,
                f"Invalid '{where}': expected a string of 1 to {MAX_STOP_CHARS} characters, "
                f"but got {len(stop)} characters instead.",
                param=where,
                code="invalid_value",
            )
    return list(stops)


def check_text(name: str, value: Any, limits: Limits) -> str:
    """A string, or an array of ``{"type": "text", "text"}`` blocks joined by newlines
    (Anthropic's system prompt and tool results, OpenAI's content parts)."""
    if isinstance(value, str):
        return value
    return text_parts(name, value)


def text_parts(where: str, parts: list[Any]) -> str:
    """The texts of ``{"type": "text", "text"}`` blocks joined by newlines; ApiError 400
    for any other block."""
    texts = []
    for j, part in enumerate(parts):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise wrong_type(at, ("object",), part)
        kind = part.get("type")
        if kind != "text":
            raise ApiError(
                400,
                f"Invalid '{at}.type': this server takes text parts only, "
                f"but got {show(kind)} instead.",
                param=f"{at}.type",
                code="invalid_value",
            )
        texts.append(required(part, at, "text", ("string",)))
    return "\n".join(texts)
