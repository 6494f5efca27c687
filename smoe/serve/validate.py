"""OpenAI's request fields in `smoe serve`: every field checked the way OpenAI checks it.

One table, ``FIELDS``, says each field's JSON type, range and what this server supports;
both endpoints validate through ``validate_request``, after smoe/serve/body.py has checked
and parsed the body itself. The table's machinery (``Spec``, ``validate_fields``) is
smoe/serve/spec.py's, which the other APIs' tables use too.

Every problem raises ``ApiError``: a 4xx in OpenAI's error shape whose one-line message
names the field, what is allowed and what was sent, e.g.
``Invalid 'temperature': expected a number between 0 and 2, but got 5 instead.``
Fields not in the table are ignored, as by vLLM (OpenAI itself refuses them).
"""

from __future__ import annotations

import json
from typing import Any

from smoe.sampling import MAX_TOP_LOGPROBS
from smoe.serve.api_error import ApiError
from smoe.serve.describe import is_int, json_type, show
from smoe.serve.logprobs import MAX_CHOICES, check_logit_bias, check_together
from smoe.serve.spec import (
    INT64,
    JSON_INSTEAD,
    Limits,
    Spec,
    check_stop,
    required,
    text_parts,
    validate_fields,
    wrong_type,
)

MAX_MESSAGES = 2048


def _off(value: Any) -> bool:
    return not value


ROLES = ("system", "developer", "user", "assistant", "tool")


def _check_messages(name: str, value: Any, limits: Limits) -> list[dict[str, Any]]:
    """The chat turns as {role, content} with text content ("developer" becomes
    "system", its meaning for models that predate it); an assistant's ``tool_calls``
    and a tool result's ``tool_call_id`` kept in the form chat templates read."""
    if not value:
        raise ApiError(
            400,
            f"Invalid '{name}': expected a non-empty array of messages, but got an empty array.",
            param=name,
            code="empty_array",
        )
    if len(value) > MAX_MESSAGES:
        raise ApiError(
            400,
            f"Invalid '{name}': expected at most {MAX_MESSAGES} messages, "
            f"but got {len(value)} instead.",
            param=name,
            code="array_above_max_length",
        )
    turns = []
    for i, message in enumerate(value):
        where = f"{name}[{i}]"
        role = message_role(where, message)
        calls = message.get("tool_calls") if role == "assistant" else None
        if calls is not None and message.get("content") is None:
            content = ""  # a turn of tool calls only
        else:
            content = required(message, where, "content", ("string", "array"))
        if isinstance(content, list):
            content = text_parts(f"{where}.content", content)
        if message.get("name") is not None and not isinstance(message["name"], str):
            raise wrong_type(f"{where}.name", ("string",), message["name"])
        turn: dict[str, Any] = {"role": "system" if role == "developer" else role}
        turn["content"] = content
        if calls is not None:
            turn["tool_calls"] = _check_calls(f"{where}.tool_calls", calls)
        if role == "tool" and message.get("tool_call_id") is not None:
            if not isinstance(message["tool_call_id"], str):
                raise wrong_type(f"{where}.tool_call_id", ("string",), message["tool_call_id"])
            turn["tool_call_id"] = message["tool_call_id"]
        turns.append(turn)
    return turns


def _check_calls(where: str, calls: Any) -> list[dict[str, Any]]:
    """An assistant's OpenAI ``tool_calls``, their arguments (JSON text) parsed into the
    object chat templates render (as mlx-lm's server does)."""
    if not isinstance(calls, list):
        raise wrong_type(where, ("array",), calls)
    out = []
    for i, call in enumerate(calls):
        at = f"{where}[{i}]"
        if not isinstance(call, dict):
            raise wrong_type(at, ("object",), call)
        function = required(call, at, "function", ("object",))
        name = required(function, f"{at}.function", "name", ("string",))
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            arguments = _json_object(f"{at}.function.arguments", arguments)
        elif arguments is None:
            arguments = {}
        elif not isinstance(arguments, dict):
            raise wrong_type(f"{at}.function.arguments", ("string", "object"), arguments)
        entry: dict[str, Any] = {
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def _json_object(where: str, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ApiError(
            400,
            f"Invalid '{where}': expected a JSON object as text, but got {show(text)} instead.",
            param=where,
            code="invalid_value",
        )
    return value


def check_tools(name: str, value: Any, limits: Limits) -> list[dict[str, Any]]:
    """OpenAI's ``tools`` (also Ollama's): ``[{type: "function", function: {name,
    description?, parameters?}}]``, as chat templates take them."""
    out = []
    for i, tool in enumerate(value):
        at = f"{name}[{i}]"
        if not isinstance(tool, dict):
            raise wrong_type(at, ("object",), tool)
        if tool.get("type", "function") != "function":
            raise ApiError(
                400,
                f"Unsupported value: '{at}.type' must be \"function\"; got {show(tool['type'])}.",
                param=f"{at}.type",
                code="unsupported_value",
            )
        function = required(tool, at, "function", ("object",))
        required(function, f"{at}.function", "name", ("string",))
        for key, kind in (("description", "string"), ("parameters", "object")):
            if function.get(key) is not None and json_type(function[key]) != kind:
                raise wrong_type(f"{at}.function.{key}", (kind,), function[key])
        out.append({"type": "function", "function": function})
    return out


def _check_prompts(name: str, value: Any, limits: Limits) -> list[str | list[int]]:
    """The prompts: a string or token ids (one prompt), or an array of those."""
    if isinstance(value, list) and value and all(isinstance(x, (str, list)) for x in value):
        return [_check_prompt(f"{name}[{i}]", x, limits) for i, x in enumerate(value)]
    return [_check_prompt(name, value, limits)]


def _check_prompt(name: str, value: Any, limits: Limits) -> str | list[int]:
    """A string, or token ids."""
    if isinstance(value, str):
        if not value:
            raise ApiError(
                400, f"Invalid '{name}': the prompt is empty.", param=name, code="invalid_value"
            )
        return value
    if not value:
        raise ApiError(
            400,
            f"Invalid '{name}': expected a string or a non-empty array of token ids, "
            "but got an empty array.",
            param=name,
            code="empty_array",
        )
    for i, token in enumerate(value):
        if not is_int(token) or not 0 <= token < limits.vocab:
            raise ApiError(
                400,
                f"Invalid '{name}[{i}]': expected a token id between 0 and "
                f"{limits.vocab - 1}, but got {show(token)} instead.",
                param=f"{name}[{i}]",
                code="invalid_value" if is_int(token) else "invalid_type",
            )
    return list(value)


def _text_format(value: dict[str, Any]) -> bool:
    return bool(value.get("type", "text") == "text")


# fmt: off
FIELDS: dict[str, Spec] = {
    # what to complete
    "messages": Spec(("array",), required=True, check=_check_messages, only="chat"),
    "prompt": Spec(("string", "array"), required=True, check=_check_prompts, only="completions"),
    "model": Spec(("string",)),  # any name: the server has one model
    # how long
    "max_tokens": Spec(("integer",), lo=0, hi="max_tokens"),  # 0: with echo only
    "max_completion_tokens": Spec(("integer",), lo=0, hi="max_tokens"),
    "stop": Spec(("string", "array"), default=[], check=check_stop),
    # sampling (OpenAI's ranges)
    # not sent: the server's defaults (ServerOptions: --temp, --top-p, generation_config)
    "temperature": Spec(("number",), lo=0, hi=2),
    "top_p": Spec(("number",), lo=0, hi=1),
    "presence_penalty": Spec(("number",), default=0.0, lo=-2, hi=2),
    "frequency_penalty": Spec(("number",), default=0.0, lo=-2, hi=2),
    "seed": Spec(("integer",), lo=INT64[0], hi=INT64[1]),
    # vLLM's extensions (top_k -1 or 0: off)
    "top_k": Spec(("integer",), default=0, lo=-1),
    "min_p": Spec(("number",), default=0.0, lo=0, hi=1),
    "repetition_penalty": Spec(("number",), default=1.0, lo=0, lo_open=True),
    "ignore_eos": Spec(("boolean",), default=False),
    # the response
    "stream": Spec(("boolean",), default=False),
    "stream_options": Spec(("object",)),
    "user": Spec(("string",)),
    "n": Spec(("integer",), default=1, lo=1, hi=MAX_CHOICES),
    "best_of": Spec(("integer",), default=1, lo=0, hi=20, only="completions",
                    supported=lambda v: v in (0, 1), unsupported="must be 1"),
    "echo": Spec(("boolean",), default=False, only="completions"),
    "suffix": Spec(("string",), only="completions", supported=_off,
                   unsupported="is not supported by this server"),
    # log-probabilities (smoe/serve/logprobs.py)
    "logprobs": Spec(("boolean",), default=False, only="chat"),
    "top_logprobs": Spec(("integer",), default=0, lo=0, hi=MAX_TOP_LOGPROBS, only="chat"),
    "logit_bias": Spec(("object",), default=(), check=check_logit_bias),
    "response_format": Spec(("object",), supported=_text_format,
                            unsupported="is not supported by this server beyond "
                                        "{\"type\": \"text\"} (no constrained decoding): "
                                        + JSON_INSTEAD),
    "tools": Spec(("array",), default=[], check=check_tools),
    "functions": Spec(("array",), supported=_off, unsupported="is not supported by this server"),
    "tool_choice": Spec(("string", "object"), default="auto",
                        supported=lambda v: v in ("none", "auto"),
                        unsupported="is not supported by this server: the model chooses "
                                    "(\"auto\") or calls none (\"none\")"),
}
# fmt: on
# The completions endpoint's logprobs is a count (0..5), not a flag (not sent: none).
COMPLETIONS_LOGPROBS = Spec(("integer",), lo=0, hi=5)


def validate_request(body: dict[str, Any], endpoint: str, limits: Limits) -> dict[str, Any]:
    """Every field of ``FIELDS`` for ``endpoint`` ("chat" or "completions"): the value
    sent, checked and converted (numbers to float), or the default. ApiError 400 names
    the first bad field; unknown fields are ignored."""
    table = {name: spec for name, spec in FIELDS.items() if spec.only in (None, endpoint)}
    if endpoint == "completions":
        table["logprobs"] = COMPLETIONS_LOGPROBS
    fields = validate_fields(body, table, limits)
    check_together(fields, endpoint, limits)
    return fields


def engine_fields(**given: Any) -> dict[str, Any]:
    """The fields the pipeline reads (``Pipeline.answer``), as an OpenAI request with only
    ``given`` sent would have them: how the other APIs hand over their requests."""
    keys = (
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "temperature",
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "top_k",
        "min_p",
        "repetition_penalty",
        "ignore_eos",
        "stream",
    )
    fields = {key: FIELDS[key].default for key in keys}
    unknown = set(given) - set(keys)
    if unknown:
        raise KeyError(f"not a pipeline field: {sorted(unknown)}")
    fields.update({k: v for k, v in given.items() if v is not None})
    return fields


def message_role(where: str, message: Any) -> str:
    """The role of the chat message at ``where``: an object whose ``role`` is one of
    ROLES; ApiError 400 if not (OpenAI's and Ollama's messages alike)."""
    if not isinstance(message, dict):
        raise wrong_type(where, ("object",), message)
    role: str = required(message, where, "role", ("string",))
    if role not in ROLES:
        raise ApiError(
            400,
            f"Invalid '{where}.role': expected one of {', '.join(ROLES)}, "
            f"but got {show(role)} instead.",
            param=f"{where}.role",
            code="invalid_value",
        )
    return role
