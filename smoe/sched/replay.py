"""Cache replay: how many records an eviction policy would read for a routing stream.

Same semantics as ``ExpertScheduler`` serving one request at a time:
- one ring of ``slots`` slots shared by all layers;
- a request is (layer, experts) for one batch at one MoE layer; its keys (layer, expert)
  are pinned together, so none of them can be evicted to make room for another;
- a requested key already resident is a hit, otherwise a miss (one record read) that
  takes an EMPTY slot if any, else evicts the policy's victim among resident keys that
  are not in the current request.
Policies see the same calls in the same order as in the scheduler (see
``smoe.sched.policy``), so ``replay(..., "lru")`` equals the real scheduler's misses
(``replay_scheduler`` checks that on small streams).

``replay_belady`` is the offline optimum under the same constraints (MIN: evict the
resident key, outside the current request, whose next use is farthest away), the bound
any online policy is measured against.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from smoe.sched.policy import EvictionPolicy, make_policy
from smoe.sched.types import Key, RingTooSmall

Request = tuple[int, Sequence[int]]  # (layer, experts) as RoutingArchive.requests() gives


@dataclass(frozen=True)
class ReplayResult:
    """Outcome of one replay. ``requests`` counts requested keys (hits + misses)."""

    policy: str
    slots: int
    requests: int
    hits: int
    misses: int
    bytes: int  # misses x record bytes

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_rate}


class KeyStream:
    """A request stream prepared once for many replays.

    ``batches[i]``: the distinct keys of request i in request order. For Belady: every key
    access flattened into ``ids`` (int per distinct key) with ``next_use`` = index of the
    next request holding the same key (len(batches) if none). Optional ``hints[i]``: keys
    the router ranked just below the used ones at request i (gate ranks top_k .. depth-1),
    for policies that take hints (``replay(..., hints=True)``).
    """

    def __init__(self, batches: list[list[Key]], hints: list[list[Key]] | None = None) -> None:
        if hints is not None and len(hints) != len(batches):
            raise ValueError("one hint list per request is needed")
        self.batches = batches
        self.hints = hints
        self.keys: list[Key] = list(dict.fromkeys(k for b in batches for k in b))
        index = {k: i for i, k in enumerate(self.keys)}
        self.offsets = np.zeros(len(batches) + 1, np.int64)
        np.cumsum([len(b) for b in batches], out=self.offsets[1:])
        self.ids = np.fromiter(
            (index[k] for b in batches for k in b), np.int64, count=int(self.offsets[-1])
        )
        self._next_use: np.ndarray | None = None

    @classmethod
    def from_requests(cls, requests: Iterable[Request]) -> KeyStream:
        return cls(
            [
                [(layer, e) for e in dict.fromkeys(int(x) for x in experts)]
                for layer, experts in requests
            ]
        )

    @property
    def num_requests(self) -> int:
        """Requested keys in the whole stream."""
        return int(self.offsets[-1])

    @property
    def working_set(self) -> int:
        """Distinct keys: the compulsory misses of any policy."""
        return len(self.keys)

    @property
    def widest(self) -> int:
        """The most keys one request pins: the smallest ring that can serve the stream."""
        return max((len(b) for b in self.batches), default=0)

    def counts(self) -> dict[Key, int]:
        """Requests per key (a frequency profile, e.g. for ``PinnedHot.from_counts``)."""
        n = np.bincount(self.ids, minlength=len(self.keys))
        return {k: int(c) for k, c in zip(self.keys, n, strict=True)}

    @property
    def next_use(self) -> np.ndarray:
        """int64 [num_requests]: for each key access, the request index of the next access to
        the same key, or len(batches) if it is never used again."""
        if self._next_use is None:
            batch_of = np.repeat(np.arange(len(self.batches)), np.diff(self.offsets))
            order = np.lexsort((np.arange(self.ids.size), self.ids))  # by key, then time
            nxt = np.full(self.ids.size, len(self.batches), np.int64)
            same = self.ids[order[1:]] == self.ids[order[:-1]]
            nxt[order[:-1][same]] = batch_of[order[1:][same]]
            self._next_use = nxt
        return self._next_use


def as_stream(source: KeyStream | Iterable[Request]) -> KeyStream:
    return source if isinstance(source, KeyStream) else KeyStream.from_requests(source)


class _Candidates(AbstractSet[Key]):
    """Resident keys minus the current request's, as a live set-like view (no copy)."""

    def __init__(self, resident: set[Key]) -> None:
        self.resident = resident
        self.pinned: AbstractSet[Key] = frozenset()

    def __contains__(self, key: object) -> bool:
        return key in self.resident and key not in self.pinned

    def __iter__(self) -> Iterator[Key]:
        return (k for k in self.resident if k not in self.pinned)

    def __len__(self) -> int:
        return len(self.resident) - sum(1 for k in self.pinned if k in self.resident)


def _check_fits(stream: KeyStream, slots: int) -> None:
    if stream.widest > slots:
        raise RingTooSmall(
            f"a request pins {stream.widest} keys but the ring has only {slots} slots",
            stream.widest,
            slots,
        )


def replay(
    source: KeyStream | Iterable[Request],
    slots: int,
    policy: str | EvictionPolicy = "lru",
    *,
    record_bytes: int = 0,
    hints: bool = False,
    **options: Any,
) -> ReplayResult:
    """Replay the stream through an online ``policy`` (a name from POLICIES, with
    ``options`` for its constructor, or an instance) on a ring of ``slots`` slots.

    ``hints``: after each request, pass the stream's hint keys that are resident to the
    policy's ``on_hint`` (an extension of the protocol the scheduler does not call yet;
    see HintablePolicy); the result is named "<policy>+hint"."""
    if policy == "belady":
        return replay_belady(source, slots, record_bytes=record_bytes)
    stream = as_stream(source)
    _check_fits(stream, slots)
    pol = make_policy(policy, **options) if isinstance(policy, str) else policy
    on_hint = getattr(pol, "on_hint", None) if hints else None
    if hints and (on_hint is None or stream.hints is None):
        raise ValueError("hints need a stream with hints and a policy with on_hint()")
    hint_lists = stream.hints if on_hint is not None else None
    resident: set[Key] = set()
    candidates = _Candidates(resident)
    on_access, on_insert, on_remove = pol.on_access, pol.on_insert, pol.on_remove
    hits = 0
    for b, keys in enumerate(stream.batches):
        candidates.pinned = frozenset(keys)
        for key in keys:
            if key in resident:
                hits += 1
                on_access(key)
                continue
            if len(resident) >= slots:
                out = pol.victim(candidates)
                if out not in candidates:
                    raise AssertionError(f"policy {pol.name} chose {out}, not a candidate")
                resident.remove(out)
                on_remove(out)
            resident.add(key)
            on_insert(key)
            on_access(key)
        if hint_lists is not None and on_hint is not None:
            for key in hint_lists[b]:
                if key in resident:
                    on_hint(key)
    n = stream.num_requests
    name = pol.name + ("+hint" if hint_lists is not None else "")
    return ReplayResult(name, slots, n, hits, n - hits, (n - hits) * record_bytes)


def replay_belady(
    source: KeyStream | Iterable[Request],
    slots: int,
    *,
    record_bytes: int = 0,
    horizon: int | None = None,
) -> ReplayResult:
    """Belady's MIN with the ring's constraints: on a miss with no free slot, evict the
    resident key outside the current request whose next use is farthest away.

    ``horizon`` (requests) limits the foresight, to measure how much of Belady's advantage
    needs how much future: next uses more than ``horizon`` requests ahead are unknown; the
    least recently used such key goes first, and only when every candidate is needed within
    the horizon does the farthest one go. (horizon = tokens x MoE layers for "perfect
    knowledge of the next tokens".)

    A max-heap of (next use, key) with lazy deletion: an entry is live while its key is
    resident and its next use is still the key's current one (next uses only grow).
    Entries are single ints (-(next_use * keys + id)) so heap compares stay cheap.
    """
    stream = as_stream(source)
    _check_fits(stream, slots)
    nkeys = max(1, len(stream.keys))
    ids: list[int] = stream.ids.tolist()
    nxt: list[int] = stream.next_use.tolist()
    offsets: list[int] = stream.offsets.tolist()
    current = [-1] * nkeys  # next use of each resident key; -1: not resident
    in_batch = [-1] * nkeys  # request index that last pinned the key
    heap: list[int] = []
    recent: OrderedDict[int, None] = OrderedDict()  # resident keys, oldest access first
    used = hits = 0
    for b in range(len(stream.batches)):
        lo, hi = offsets[b], offsets[b + 1]
        for i in range(lo, hi):
            in_batch[ids[i]] = b
        for i in range(lo, hi):
            key, use = ids[i], nxt[i]
            if current[key] >= 0:
                hits += 1
            elif used < slots:
                used += 1
            elif (
                horizon is not None
                and (old := _oldest_unforeseen(recent, current, in_batch, b, horizon)) is not None
            ):
                current[old] = -1  # its heap entries are stale now
                del recent[old]
            else:
                skipped = []
                while True:
                    entry = heapq.heappop(heap)
                    use_v, victim = divmod(-entry, nkeys)
                    if current[victim] != use_v:
                        continue  # stale
                    if in_batch[victim] == b:
                        skipped.append(entry)  # pinned by this request
                        continue
                    current[victim] = -1
                    recent.pop(victim, None)
                    break
                for entry in skipped:
                    heapq.heappush(heap, entry)
            current[key] = use
            heapq.heappush(heap, -(use * nkeys + key))
            if horizon is not None:
                recent[key] = None
                recent.move_to_end(key)
        if len(heap) > 4 * slots + 64:  # drop stale entries
            heap = [-(current[k] * nkeys + k) for k in range(nkeys) if current[k] >= 0]
            heapq.heapify(heap)
    n = stream.num_requests
    name = "belady" if horizon is None else f"belady-h{horizon}"
    return ReplayResult(name, slots, n, hits, n - hits, (n - hits) * record_bytes)


def _oldest_unforeseen(
    recent: OrderedDict[int, None], current: list[int], in_batch: list[int], b: int, horizon: int
) -> int | None:
    """The least recently used resident key, outside request ``b``, not needed within the
    horizon; None if every candidate is needed within it."""
    for key in recent:
        if current[key] - b > horizon and in_batch[key] != b:
            return key
    return None


class _InstantBackend:
    """A ReadBackend whose reads finish at once (the replay needs only the slot table)."""

    def __init__(self, record_bytes: int) -> None:
        self.record_bytes = record_bytes

    async def read(self, record: int, slot: int, priority: int = 0) -> int:
        return self.record_bytes


def replay_scheduler(
    source: KeyStream | Iterable[Request],
    slots: int,
    policy: str | EvictionPolicy = "lru",
    *,
    record_bytes: int = 0,
) -> ReplayResult:
    """The same replay through the real ``ExpertScheduler`` (acquire, release, one request
    at a time, instant reads): a cross-check of ``replay``. O(slots) per request; for small
    streams."""
    from smoe.sched.scheduler import ExpertScheduler

    stream = as_stream(source)

    async def run() -> tuple[int, int, str]:
        sched = ExpertScheduler(
            slots,
            _InstantBackend(record_bytes),
            record_of=lambda k: k[0] * 1_000_003 + k[1],
            record_bytes=record_bytes,
            policy=policy,
        )
        for keys in stream.batches:
            if not keys:
                continue
            got = await sched.acquire(keys[0][0], [e for _, e in keys])
            sched.release(got)
        await sched.close()
        return sched.stats.hits, sched.stats.misses, sched.policy.name

    hits, misses, name = asyncio.run(run())
    return ReplayResult(name, slots, hits + misses, hits, misses, misses * record_bytes)
