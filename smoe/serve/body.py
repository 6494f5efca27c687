"""The request body of `smoe serve`, checked before its fields: media type and charset,
nesting depth, JSON syntax (no NaN or Infinity), finite numbers and valid Unicode. Its
size is aiohttp's ``client_max_size`` (``MAX_BODY_BYTES`` by default).

Every problem raises ``ApiError`` (415 for the media type, 400 for the rest) with a
one-line message; the fields themselves are checked next, by smoe/serve/validate.py.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from smoe.serve.api_error import ApiError
from smoe.serve.describe import BadNumber, noun, show
from smoe.serve.spec import expected
from smoe.serve.validate import FIELDS

MAX_BODY_BYTES = 4 * 1024**2  # a 128k-token prompt, even JSON-escaped, fits
MAX_DEPTH = 64  # a request needs 5 levels; deeper is an attack on the parser


# What ``curl -d`` and other quick clients declare for a JSON body they did not label:
# taken as JSON when it parses as JSON (as ollama, mlx_lm.server and llama-server do).
LOOSE_TYPES = ("application/x-www-form-urlencoded", "text/plain")


def check_content_type(header: str | None) -> None:
    """415 unless the body is declared JSON, a loose type (``LOOSE_TYPES``: then parsed
    as JSON like any other), or not declared, in UTF-8 (RFC 8259 §8.1)."""
    if header is None or not header.strip():
        return
    mime, *params = header.split(";")
    mime = mime.strip().lower()
    if mime not in (*LOOSE_TYPES, "application/json") and not (
        mime.startswith("application/") and mime.endswith("+json")
    ):
        raise ApiError(
            415,
            f"Invalid 'Content-Type': {show(mime)} is not supported; send 'application/json'",
            param="Content-Type",
            code="unsupported_media_type",
        )
    for param in params:
        key, _, value = param.partition("=")
        if key.strip().lower() != "charset":
            continue
        charset = value.strip().strip('"').lower()
        if charset not in ("utf-8", "utf8"):
            raise ApiError(
                415,
                f"Invalid 'Content-Type': charset {show(charset)} is not supported; JSON "
                "bodies must be UTF-8 (send 'application/json; charset=utf-8' or no charset)",
                param="Content-Type",
                code="unsupported_media_type",
            )


_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)  # an unterminated one ends the body
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in ``raw`` (JSON text, maybe invalid),
    found without parsing, so without recursion: strings removed, then brackets counted.
    Linear time: possessive quantifiers never backtrack, and a string left open runs to
    the end of the body."""
    brackets = _STRING.sub(b"", raw).translate(None, delete=_NOT_BRACKETS)
    if not brackets:
        return 0
    a = np.frombuffer(brackets, np.uint8)
    steps = np.where((a == ord("[")) | (a == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object; ApiError 400 for anything else (see the module doc)."""
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and json_depth(raw) > MAX_DEPTH:
        raise ApiError(
            400,
            f"the request body nests arrays and objects deeper than {MAX_DEPTH} levels",
            code="invalid_json",
        )
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ApiError(
            400,
            f"the request body is not valid UTF-8 (byte {e.start}); send UTF-8 JSON",
            code="invalid_json",
        ) from None
    bad: list[BadNumber] = []

    def bad_number(literal: str) -> BadNumber:
        bad.append(BadNumber(literal))
        return bad[-1]

    def parse_float(literal: str) -> float | BadNumber:
        value = float(literal)
        return value if math.isfinite(value) else bad_number(literal)

    try:
        body = json.loads(text, parse_constant=bad_number, parse_float=parse_float)
    except json.JSONDecodeError as e:
        raise ApiError(
            400,
            f"the request body is not valid JSON: {e.msg} at character {e.pos}",
            code="invalid_json",
        ) from None
    except ValueError:  # Python's limit of 4300 digits for an integer
        raise ApiError(
            400, "the request body has an integer of over 4300 digits", code="invalid_json"
        ) from None
    except RecursionError:  # cannot happen below MAX_DEPTH; kept as a last line of defence
        raise ApiError(400, "the request body nests too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(
            400,
            f"the request body must be a JSON object, not {noun(body)}",
            code="invalid_json",
        )
    if bad or _SURROGATE_ESCAPE.search(raw):
        _check_leaves(body)
    return body


def _check_leaves(body: dict[str, Any]) -> None:
    """400 naming a NaN/Infinity/overflowing number or a lone surrogate (a ``\\ud800``
    escape without its pair, which no UTF-8 text can hold) anywhere in the body."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        node, path = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(key, str):
                if _SURROGATE.search(key):
                    raise _surrogate(path or "the body", key)
                where = f"{path}.{key}" if path else key
            else:
                where = f"{path}[{key}]"
            if isinstance(value, (dict, list)):
                stack.append((value, where))
            elif isinstance(value, BadNumber):
                spec = FIELDS.get(where)
                allowed = f"; expected {expected(spec)}" if spec else ""
                raise ApiError(
                    400,
                    f"Invalid '{where}': {value.literal} is not a finite 64-bit number{allowed}.",
                    param=where,
                    code="invalid_value",
                )
            elif isinstance(value, str) and _SURROGATE.search(value):
                raise _surrogate(where, value)


def _surrogate(where: str, text: str) -> ApiError:
    found = _SURROGATE.search(text)
    code = ord(found.group()) if found else 0
    return ApiError(
        400,
        f"Invalid '{where}': it holds a lone surrogate U+{code:04X}, which is not Unicode; "
        "escape characters beyond U+FFFF as a surrogate pair",
        param=where,
        code="invalid_value",
    )
