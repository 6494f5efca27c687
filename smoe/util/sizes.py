"""Byte sizes: parse '6GB' / '512MiB' (once, where a size enters: a flag, an option), print
1.36 GB, suggest a round size for a flag, and count the slots a budget holds."""

from __future__ import annotations

import re
from collections.abc import Callable

from smoe.errors import SmoeError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


class Size(int):
    """A byte count read from text, which keeps the text: a refusal quotes the user's own
    words ('a memory budget of 50MB ...'), while arithmetic sees a plain int."""

    text: str

    def __new__(cls, nbytes: int, text: str = "") -> Size:
        size = super().__new__(cls, nbytes)
        size.text = text
        return size

    def __reduce__(self) -> tuple[type[Size], tuple[int, str]]:  # pickle, copy: the text too
        return Size, (int(self), self.text)


def parse_size(text: str | int) -> int:
    """'6GB' -> 6_000_000_000; '1.5GiB' -> 1610612736 (a ``Size`` keeping the text); an int
    is returned as it is. Raises SmoeError on nonsense."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise SmoeError(f"cannot read size '{text}'; write it like 6GB, 512MB or 1.5GiB")
    return Size(int(float(m.group(1)) * _UNITS[m.group(2).lower()]), text)


def as_written(nbytes: int, otherwise: Callable[[int], str] | None = None) -> str:
    """A size as its user wrote it (a ``Size``'s text, stripped), else ``otherwise(nbytes)``
    (default ``format_bytes``): a number given in Python has no text."""
    if isinstance(nbytes, Size):
        return nbytes.text.strip()
    return (otherwise or format_bytes)(nbytes)


def format_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def round_size(nbytes: int, *, up: bool = True) -> str:
    """A round size to suggest for a flag: the least at or above ``nbytes`` (``up``), else
    the most at or below it; tenths of a GB from 1 GB, whole MB, KB or bytes below:
    84.9 MB -> '85MB', 1.23 GB -> '1.3GB' (up), 4.29 GB -> '4.2GB' (down)."""

    def units(scale: int) -> int:  # whole units of ``scale``, in integers (no float error)
        return -(-nbytes // scale) if up else nbytes // scale

    if nbytes >= 10**9:
        tenths = units(10**8)
        return f"{tenths // 10}GB" if tenths % 10 == 0 else f"{tenths // 10}.{tenths % 10}GB"
    for unit, scale in (("MB", 10**6), ("KB", 10**3)):
        if nbytes >= scale:
            return f"{units(scale)}{unit}"
    return f"{max(nbytes, 0)}B"


def slots_for_budget(budget: int, slot_bytes: int, *, max_slots: int | None = None) -> int:
    """The most slots of ``slot_bytes`` that ``budget`` bytes hold (0 for a budget below
    one), at most ``max_slots``: the ring's size with --memory and without it. Never
    raises; whether that many are enough is the caller's (``smoe.plan.budget.Fit``)."""
    slots = max(budget, 0) // slot_bytes
    return slots if max_slots is None else min(slots, max_slots)
