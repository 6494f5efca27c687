"""Eviction policies: which unpinned, resident slot gives way when a record needs a slot.

A policy only ranks candidates; the scheduler decides which slots are candidates at all
(never pinned, never loading), so no policy can break the ring's safety rules.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

from smoe.sched.types import Key


class EvictionPolicy(Protocol):
    """What the slot table tells a policy, and what it asks of it."""

    name: str

    def on_insert(self, key: Key) -> None:
        """``key`` was just loaded into the ring."""

    def on_access(self, key: Key) -> None:
        """``key`` was asked for (a hit, or the demand that loaded it)."""

    def on_remove(self, key: Key) -> None:
        """``key`` left the ring (evicted or failed)."""

    def victim(self, candidates: Iterable[Key]) -> Key:
        """The candidate to evict; ``candidates`` is non-empty."""
        ...


class LRU:
    """Least recently used: evict the key whose last access is oldest."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def on_insert(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, candidates: Iterable[Key]) -> Key:
        allowed = set(candidates)
        for key in self._order:  # oldest first
            if key in allowed:
                return key
        # A candidate the policy never saw (should not happen): any is fine.
        return next(iter(allowed))


POLICIES: dict[str, type[LRU]] = {"lru": LRU}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy '{name}'; choose one of {sorted(POLICIES)}"
        ) from None
