"""Reading a vault's small JSON files as untrusted input: bounded, strict, and typed.

``read_limited`` and ``parse_json`` turn a file into a JSON value or a VaultError (too big,
unreadable, not strict JSON); ``Check`` then reads that value field by field with the type
and range asked for. Every failure names the file, the field and the fix, never a traceback.
This module imports no MLX.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, NoReturn

from smoe.errors import VaultError
from smoe.util.files import NotRegularFile, open_regular

CONVERT_AGAIN = "convert the model again"  # the fix for a vault damaged or made wrongly
INT64_MAX = 2**63 - 1  # file offsets and sizes (off_t)
DIM_MAX = 2**31 - 1  # MLX sizes each dimension with a 32-bit int


def show(value: Any) -> str:
    """An untrusted value for a one-line message: short, and ASCII (a lone surrogate from
    the JSON cannot be printed)."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    text = ascii(value[:48] if isinstance(value, str) else value)
    return text if len(text) <= 48 else text[:45] + "..."


class Check:
    """Typed reads of one untrusted JSON document. Each accessor returns the value with the
    type and range asked for, or raises VaultError naming the file, the field and the fix."""

    def __init__(self, where: str, fix: str = CONVERT_AGAIN) -> None:
        self.where = where
        self.fix = fix

    def fail(self, name: str, problem: str) -> NoReturn:
        raise VaultError(f"{self.where}: {name} {problem}; {self.fix}")

    def obj(self, value: Any, name: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(name, f"must be a JSON object, not {show(value)}")
        return value

    def key(self, d: dict[str, Any], key: str, parent: str) -> Any:
        name = f"{parent}.{key}" if parent else key
        if key not in d:
            self.fail(name, "is missing")
        return d[key]

    def int_(self, value: Any, name: str, lo: int = 0, hi: int = INT64_MAX) -> int:
        # bool is an int subclass and JSON's 1.0 a float: neither is a count or an offset.
        if type(value) is not int or not lo <= value <= hi:
            self.fail(name, f"must be an integer from {lo} to {hi}, not {show(value)}")
        return value

    def opt_int(self, value: Any, name: str, lo: int = 0, hi: int = INT64_MAX) -> int | None:
        return None if value is None else self.int_(value, name, lo, hi)

    def bool_(self, value: Any, name: str) -> bool:
        if type(value) is not bool:
            self.fail(name, f"must be true or false, not {show(value)}")
        return value

    def str_(
        self,
        value: Any,
        name: str,
        choices: tuple[str, ...] | None = None,
        pattern: re.Pattern[str] | None = None,
        max_len: int = 4096,
    ) -> str:
        if not isinstance(value, str) or len(value) > max_len:
            self.fail(name, f"must be a string of at most {max_len} characters, not {show(value)}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            self.fail(name, f"is not valid Unicode ({show(value)})")
        if choices is not None and value not in choices:
            self.fail(name, f"must be one of {', '.join(choices)}, not {show(value)}")
        if pattern is not None and not pattern.fullmatch(value):
            self.fail(name, f"is not a valid value ({show(value)})")
        return value

    def list_(self, value: Any, name: str, lo: int = 0, hi: int = INT64_MAX) -> list[Any]:
        if not isinstance(value, list) or not lo <= len(value) <= hi:
            self.fail(name, f"must be a list of {lo} to {hi} items, not {show(value)}")
        return value


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):  # ambiguous: other JSON readers keep the first, Python the last
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"the key {show(k)} appears twice in one object")
            seen.add(k)
    return d


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def read_limited(path: Path, limit: int, fix: str = CONVERT_AGAIN) -> bytes:
    """The bytes of a small vault file, or a VaultError when it is unreadable, too big, or
    not a regular file (a FIFO there would block the read forever)."""
    try:
        with open_regular(path) as f:
            data = f.read(limit + 1)
    except NotRegularFile as e:
        raise VaultError(f"{path} is {e.kind}, not a regular file; {fix}") from None
    except OSError as e:
        raise VaultError(f"{path} is unreadable ({e.strerror}); {fix}") from None
    if len(data) > limit:
        raise VaultError(f"{path} is larger than {limit} bytes, too large to be ours; {fix}")
    return data


def parse_json(data: bytes, path: Path) -> Any:
    """Strict JSON: UTF-8, no NaN or Infinity, no key twice in an object, bounded nesting.
    Raises VaultError naming ``path`` and the first problem."""
    try:
        return json.loads(
            data.decode("utf-8"),
            object_pairs_hook=_no_duplicate_keys,
            parse_constant=_no_constant,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        reason = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise VaultError(f"{path} is not valid JSON ({reason}); {CONVERT_AGAIN}") from None
