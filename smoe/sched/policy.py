"""Eviction policies: which unpinned, resident slot gives way when a record needs a slot.

A policy only ranks candidates; the scheduler decides which slots are candidates at all
(never pinned, never loading), so no policy can break the ring's safety rules.

Call order the scheduler (and ``smoe.telemetry.replay``) follows for one requested key:
- hit:  ``on_access(key)``
- miss: ``victim(candidates)`` and ``on_remove(victim)`` if the ring is full, then
  ``on_insert(key)`` and ``on_access(key)``.
A speculative load calls ``on_insert`` alone; its first ``on_access`` is the demand that
uses it. Policies that count accesses therefore treat the first access after an insert as
the access that loaded the key, not as a second one.

``victim`` gets the candidates as an iterable; when it is a set-like view (the scheduler
passes ``dict.keys()``) policies test membership on it directly instead of copying it, so
picking a victim costs O(1) amortised (LRU family) or O(log n) (LFU), not O(ring).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any, Protocol

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


class HintablePolicy(EvictionPolicy, Protocol):
    """A policy that also takes the router's near misses as a hint: ``ExpertScheduler.hint``
    calls it for the resident ones after a request (the engine does with a "+hint" policy,
    ``smoe.sched.hints``), and ``smoe.telemetry.replay`` with ``hints=True``. LRU, LRUPerLayer
    and LFU implement it."""

    def on_hint(self, key: Key) -> None:
        """Resident ``key`` ranked just below the used experts of the current request: it
        is likely wanted soon. Not an access (counts no hit)."""


def _as_set(candidates: Iterable[Key]) -> AbstractSet[Key]:
    """Membership test without copying when the caller already passes a set-like view."""
    return candidates if isinstance(candidates, AbstractSet) else set(candidates)


def _oldest_in(order: Iterable[Key], allowed: AbstractSet[Key]) -> Key | None:
    """First key of ``order`` (oldest first) that is a candidate. Non-candidates are the
    current request's keys (just accessed, so near the young end): the scan is short."""
    for key in order:
        if key in allowed:
            return key
    return None


def _any(allowed: AbstractSet[Key]) -> Key:
    # A candidate the policy never saw (should not happen): any is fine.
    return next(iter(allowed))


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

    def on_hint(self, key: Key) -> None:
        self.on_access(key)  # refresh as if used now

    def victim(self, candidates: Iterable[Key]) -> Key:
        allowed = _as_set(candidates)
        key = _oldest_in(self._order, allowed)
        return key if key is not None else _any(allowed)


class LRUPerLayer:
    """LRU inside each layer, with layers kept at equal shares of the ring.

    The victim is the oldest candidate of the layer holding the most resident keys (ties:
    the lower layer), so every layer keeps about ring/layers slots, like a ring split into
    per-layer caches (what colibri and llama.cpp PR #25294 do) but without fixed borders.
    O(layers) per victim.
    """

    name = "lru-layer"

    def __init__(self) -> None:
        self._by_layer: dict[int, OrderedDict[Key, None]] = {}

    def on_insert(self, key: Key) -> None:
        order = self._by_layer.setdefault(key[0], OrderedDict())
        order[key] = None
        order.move_to_end(key)

    def on_access(self, key: Key) -> None:
        order = self._by_layer.get(key[0])
        if order is not None and key in order:
            order.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        order = self._by_layer.get(key[0])
        if order is not None:
            order.pop(key, None)

    def on_hint(self, key: Key) -> None:
        self.on_access(key)  # refresh as if used now

    def victim(self, candidates: Iterable[Key]) -> Key:
        allowed = _as_set(candidates)
        layers = sorted(self._by_layer, key=lambda layer: (-len(self._by_layer[layer]), layer))
        for layer in layers:  # nearly always the first layer has a candidate
            key = _oldest_in(self._by_layer[layer], allowed)
            if key is not None:
                return key
        return _any(allowed)


class SLRU:
    """Segmented LRU: new keys enter a probationary segment; a second access moves them to a
    protected segment of at most ``protected_share`` of the ring, whose overflow drops back
    to the young end of probation. Victims come from probation first (oldest first).

    ``capacity`` (slots), when not given, is the number of resident keys at the first
    eviction (the ring is full then); until that the protected segment is unbounded.
    """

    name = "slru"

    def __init__(self, protected_share: float = 0.8, *, capacity: int | None = None) -> None:
        if not 0.0 <= protected_share <= 1.0:
            raise ValueError("protected_share must lie in [0, 1]")
        self.protected_share = protected_share
        self._capacity = capacity
        self._probation: OrderedDict[Key, None] = OrderedDict()
        self._protected: OrderedDict[Key, None] = OrderedDict()
        self._fresh: set[Key] = set()  # inserted, first access (the demand) not seen yet

    def on_insert(self, key: Key) -> None:
        if key in self._probation or key in self._protected:
            return
        self._probation[key] = None
        self._fresh.add(key)

    def on_access(self, key: Key) -> None:
        if key in self._fresh:
            self._fresh.discard(key)
        elif key in self._probation:
            del self._probation[key]
            self._protected[key] = None
            if self._capacity is not None:
                limit = max(1, int(self.protected_share * self._capacity))
                while len(self._protected) > limit:
                    old, _ = self._protected.popitem(last=False)
                    self._probation[old] = None  # demoted keys get one more chance
        elif key in self._protected:
            self._protected.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        self._fresh.discard(key)
        self._probation.pop(key, None)
        self._protected.pop(key, None)

    def victim(self, candidates: Iterable[Key]) -> Key:
        if self._capacity is None:
            self._capacity = len(self._probation) + len(self._protected)
        allowed = _as_set(candidates)
        key = _oldest_in(self._probation, allowed)
        if key is None:
            key = _oldest_in(self._protected, allowed)
        return key if key is not None else _any(allowed)


class ARC:
    """Adaptive Replacement Cache (Megiddo & Modha, FAST 2003) under the scheduler's protocol.

    T1 holds keys seen once recently, T2 keys seen at least twice; ghost lists B1/B2 remember
    keys recently evicted from each. A re-insert of a B1 ghost grows the target size ``p`` of
    T1, one of a B2 ghost shrinks it. The victim is the oldest candidate of T1 when
    |T1| > p, else of T2 (falling back to the other list when one has no candidate: the
    scheduler may exclude keys).

    Differences from the paper forced by the protocol: the victim is chosen before the
    incoming key is known, so ``p`` adapts one miss later than in the paper and the
    "x in B2 and |T1| = p" tie-break is dropped. Only evictions this policy chose become
    ghosts (failed reads also call ``on_remove``). ``capacity`` (c, slots) is learned as
    the most keys ever resident when not given; ghosts are bounded by |T1|+|B1| <= c and
    |T1|+|T2|+|B1|+|B2| <= 2c.
    """

    name = "arc"

    def __init__(self, *, capacity: int | None = None) -> None:
        self._c = capacity or 0
        self._learn = capacity is None
        self.p = 0.0  # target size of T1
        self._t1: OrderedDict[Key, None] = OrderedDict()
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()
        self._fresh: set[Key] = set()
        self._evicting: Key | None = None

    def on_insert(self, key: Key) -> None:
        if key in self._t1 or key in self._t2:
            return
        if key in self._b1:  # T1 was too small: grow its target
            self.p = min(float(self._c), self.p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:  # T2 was too small: shrink T1's target
            self.p = max(0.0, self.p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._fresh.add(key)
        if self._learn:
            self._c = max(self._c, len(self._t1) + len(self._t2))
        self._trim_ghosts()

    def on_access(self, key: Key) -> None:
        if key in self._fresh:
            self._fresh.discard(key)  # the demand that loaded it, already placed
        elif key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        self._fresh.discard(key)
        chosen, self._evicting = key == self._evicting, None
        if key in self._t1:
            del self._t1[key]
            if chosen:
                self._b1[key] = None
        elif key in self._t2:
            del self._t2[key]
            if chosen:
                self._b2[key] = None
        self._trim_ghosts()

    def victim(self, candidates: Iterable[Key]) -> Key:
        allowed = _as_set(candidates)
        first, second = (self._t1, self._t2) if len(self._t1) > self.p else (self._t2, self._t1)
        key = _oldest_in(first, allowed)
        if key is None:
            key = _oldest_in(second, allowed)
        if key is None:
            key = _any(allowed)
        self._evicting = key
        return key

    def _trim_ghosts(self) -> None:
        while self._b1 and len(self._t1) + len(self._b1) > self._c:
            self._b1.popitem(last=False)
        total = len(self._t1) + len(self._t2) + len(self._b1)
        while self._b2 and total + len(self._b2) > 2 * self._c:
            self._b2.popitem(last=False)


class LFU:
    """Least frequently used with exponential ageing (LRFU, Lee et al. 2001).

    A key's weight is the sum over its accesses of 2^(-age / half_life), age counted in
    accesses to the whole ring; the victim is the candidate of least weight. Stored as
    log2-weights anchored in time (log2 sum 2^(t_i / H)), whose order never changes as time
    passes, so a min-heap with lazy deletion finds the victim in O(log n).
    half_life -> 0 is LRU; half_life -> infinity is plain LFU.

    ``half_life`` in accesses; by default ``half_life_slots`` x the ring's slots (given as
    ``capacity`` or learned at the first eviction; until then accesses are summarised as
    (count, last access), a warm-up approximation). ``remember`` keeps the weights of
    evicted keys (one float per key ever seen: experts x layers), so a key that returns is
    judged on its history, not as new. ``on_hint`` adds ``hint_weight`` of an access.
    """

    name = "lfu"

    def __init__(
        self,
        half_life: float | None = None,
        *,
        half_life_slots: float = 2.0,
        capacity: int | None = None,
        remember: bool = True,
        hint_weight: float = 0.1,
    ) -> None:
        if half_life is None and capacity is not None:
            half_life = half_life_slots * capacity
        if half_life is not None and half_life <= 0:
            raise ValueError("half_life must be positive")
        self._h = half_life
        self.half_life_slots = half_life_slots
        self.remember = remember
        self.hint_weight = hint_weight
        self._t = 0  # accesses so far
        self._weight: dict[Key, float] = {}  # log2 weight, once the half-life is known
        self._warm: dict[Key, tuple[int, int]] = {}  # (count, last access) before that
        self._resident: set[Key] = set()
        self._provisional: set[Key] = set()  # weight given at insert, replaced at first use
        self._heap: list[tuple[float, Key]] = []

    @property
    def half_life(self) -> float | None:
        return self._h

    def on_insert(self, key: Key) -> None:
        if key in self._resident:
            return
        self._resident.add(key)
        if self._h is not None:
            if key not in self._weight:  # as if accessed now, until the first real access
                self._weight[key] = self._t / self._h
                self._provisional.add(key)
            heapq.heappush(self._heap, (self._weight[key], key))

    def on_access(self, key: Key) -> None:
        if key not in self._resident:
            return
        self._t += 1
        if self._h is None:
            count, _ = self._warm.get(key, (0, 0))
            self._warm[key] = (count + 1, self._t)
            return
        self._bump(key, self._t / self._h)

    def on_hint(self, key: Key) -> None:
        if key in self._resident and self._h is not None and key not in self._provisional:
            self._bump(key, self._t / self._h + math.log2(self.hint_weight))

    def _bump(self, key: Key, now: float) -> None:
        """Add 2^now to the key's weight (log2 domain: no overflow however long the run)."""
        old = self._weight.get(key)
        if old is None or key in self._provisional:
            self._provisional.discard(key)
            new = now
        else:
            new = max(old, now) + math.log2(1.0 + 2.0 ** -abs(old - now))
        self._weight[key] = new
        heapq.heappush(self._heap, (new, key))
        if len(self._heap) > 4 * len(self._resident) + 64:
            self._compact()

    def weight_of(self, key: Key) -> float:
        """``key``'s weight as eviction ranks it (log2; an evicted key's is remembered):
        -inf for a key never accessed, and for every key before the first eviction."""
        return self._weight.get(key, -math.inf)

    def on_remove(self, key: Key) -> None:
        self._resident.discard(key)
        if key in self._provisional or not self.remember:
            self._provisional.discard(key)
            self._weight.pop(key, None)
            self._warm.pop(key, None)

    def victim(self, candidates: Iterable[Key]) -> Key:
        allowed = _as_set(candidates)
        if self._h is None:
            self._start(len(self._resident))
        heap, skipped = self._heap, []
        found: Key | None = None
        while heap:
            weight, key = heap[0]
            if key not in self._resident or self._weight.get(key) != weight:
                heapq.heappop(heap)  # stale entry
            elif key in allowed:
                found = key
                break
            else:  # pinned now: keep for later
                skipped.append(heapq.heappop(heap))
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found if found is not None else _any(allowed)

    def _start(self, slots: int) -> None:
        """Fix the half-life at the first eviction and convert the warm-up summaries."""
        self._h = max(1.0, self.half_life_slots * slots)
        for key, (count, last) in self._warm.items():
            self._weight[key] = math.log2(count) + last / self._h
        self._warm.clear()
        for key in self._resident:  # inserted but never accessed
            if key not in self._weight:
                self._weight[key] = self._t / self._h
                self._provisional.add(key)
        self._compact()

    def _compact(self) -> None:
        self._heap = [(self._weight[k], k) for k in self._resident if k in self._weight]
        heapq.heapify(self._heap)


class PinnedHot:
    """A frequency-pinned hot set: keys in ``hot`` are never evicted while any other key is a
    candidate; LRU among the rest, then LRU among hot keys.

    ``hot`` typically comes from a routing profile (``PinnedHot.from_counts``). Without one
    it is plain LRU.
    """

    name = "hot"

    def __init__(self, hot: Iterable[Key] = ()) -> None:
        self.hot: frozenset[Key] = frozenset(hot)
        self._hot: OrderedDict[Key, None] = OrderedDict()
        self._cold: OrderedDict[Key, None] = OrderedDict()

    @classmethod
    def from_counts(cls, counts: Mapping[Key, int], size: int) -> PinnedHot:
        """Pin the ``size`` most requested keys of a profile (ties: smaller key first)."""
        ranked = sorted(counts, key=lambda k: (-counts[k], k))
        return cls(ranked[: max(0, size)])

    def on_insert(self, key: Key) -> None:
        order = self._hot if key in self.hot else self._cold
        order[key] = None
        order.move_to_end(key)

    def on_access(self, key: Key) -> None:
        order = self._hot if key in self.hot else self._cold
        if key in order:
            order.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        self._hot.pop(key, None)
        self._cold.pop(key, None)

    def victim(self, candidates: Iterable[Key]) -> Key:
        allowed = _as_set(candidates)
        key = _oldest_in(self._cold, allowed)
        if key is None:
            key = _oldest_in(self._hot, allowed)
        return key if key is not None else _any(allowed)


POLICIES: dict[str, Callable[..., EvictionPolicy]] = {
    "lru": LRU,
    "lru-layer": LRUPerLayer,
    "lfu": LFU,
    "slru": SLRU,
    "arc": ARC,
    "hot": PinnedHot,
}


def make_policy(name: str, **options: Any) -> EvictionPolicy:
    """A fresh policy by name; ``options`` go to its constructor (e.g. ``hot=`` for "hot",
    ``half_life=`` for "lfu", ``capacity=`` for "arc"/"slru"/"lfu")."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy '{name}'; choose one of {sorted(POLICIES)}"
        ) from None
    return factory(**options)
