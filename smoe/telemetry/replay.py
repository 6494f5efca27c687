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

Two kinds of foresight the engine has can be replayed with a stream that carries them:
- ``hints=True``: after request i, its hint keys that are resident go to the policy's
  ``on_hint`` (``ExpertScheduler.hint``; the router's runners-up, ``smoe.sched.hints``);
- ``prefetch=True``: after request i (and its hints), its prefetch keys that are not
  resident are loaded speculatively, as ``ExpertScheduler.prefetch`` does (lookahead, gate
  echo): an EMPTY slot, else the policy's victim among resident keys not loaded by this
  same prefetch, else the rest of the list is dropped. Reads are instant, so a prefetched
  key is resident when the next request comes. ``misses`` then counts demand misses (the
  reads a computation waits for) and ``spec_reads`` the speculative ones; ``bytes`` counts
  both.

``replay_belady`` is the offline optimum under the same constraints (MIN: evict the
resident key, outside the current request, whose next use is farthest away), the bound
any online policy is measured against.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from smoe.sched.governor import SpeculationGovernor
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
    misses: int  # demand misses: reads a request waited for
    bytes: int  # (misses + spec_reads) x record bytes
    spec_reads: int = 0  # speculative reads (prefetch), 0 without
    spec_used: int = 0  # of those, keys a later request used while still resident

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    @property
    def reads(self) -> int:
        """Records read in all: demand misses and speculative reads."""
        return self.misses + self.spec_reads

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_rate, "reads": self.reads}


class KeyStream:
    """A request stream prepared once for many replays.

    ``batches[i]``: the distinct keys of request i in request order. For Belady: every key
    access flattened into ``ids`` (int per distinct key) with ``next_use`` = index of the
    next request holding the same key (len(batches) if none). Optional ``hints[i]``: keys
    the router ranked just below the used ones at request i (gate ranks top_k .. depth-1),
    for policies that take hints (``replay(..., hints=True)``). Optional ``prefetch[i]``:
    keys read speculatively right after request i (``replay(..., prefetch=True)``).
    """

    def __init__(
        self,
        batches: list[list[Key]],
        hints: list[list[Key]] | None = None,
        prefetch: list[list[Key]] | None = None,
    ) -> None:
        if hints is not None and len(hints) != len(batches):
            raise ValueError("one hint list per request is needed")
        if prefetch is not None and len(prefetch) != len(batches):
            raise ValueError("one prefetch list per request is needed")
        self.batches = batches
        self.hints = hints
        self.prefetch = prefetch
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

    def with_foresight(
        self, hints: list[list[Key]] | None = None, prefetch: list[list[Key]] | None = None
    ) -> KeyStream:
        """The same requests with other hints/prefetch lists (next uses are shared)."""
        twin = KeyStream.__new__(KeyStream)
        twin.__dict__.update(self.__dict__)
        twin.hints, twin.prefetch = hints, prefetch
        if hints is not None and len(hints) != len(self.batches):
            raise ValueError("one hint list per request is needed")
        if prefetch is not None and len(prefetch) != len(self.batches):
            raise ValueError("one prefetch list per request is needed")
        return twin

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


class _ReplayRing:
    """The ring ``replay`` simulates: which keys are resident, the policy told of every
    change, and which resident keys were prefetched and not used yet."""

    def __init__(self, policy: EvictionPolicy, slots: int) -> None:
        self.policy = policy
        self.slots = slots
        self.resident: set[Key] = set()
        self.candidates = _Candidates(self.resident)
        self.speculative: set[Key] = set()  # prefetched, not used yet
        self.hits = self.spec_reads = self.spec_used = 0
        self.governor = SpeculationGovernor()  # as the scheduler's: bets that do not pay stop

    def evict(self) -> None:
        out = self.policy.victim(self.candidates)
        if out not in self.candidates:
            raise AssertionError(f"policy {self.policy.name} chose {out}, not a candidate")
        self.resident.remove(out)
        if out in self.speculative:  # a bet evicted unused
            self.speculative.discard(out)
            self.governor.outcome(used=False)
        self.policy.on_remove(out)

    def demand(self, keys: Sequence[Key]) -> None:
        """One request: its keys pinned, each a hit or a read (evicting when full)."""
        # The inner loop of every sweep: the policy's methods bound once per request.
        resident, speculative = self.resident, self.speculative
        on_access, on_insert = self.policy.on_access, self.policy.on_insert
        self.candidates.pinned = frozenset(keys)
        for key in keys:
            if key in resident:
                self.hits += 1
                if key in speculative:
                    speculative.discard(key)
                    self.spec_used += 1
                    self.governor.outcome(used=True)
                on_access(key)
                continue
            if len(resident) >= self.slots:
                self.evict()
            resident.add(key)
            on_insert(key)
            on_access(key)

    def hint(self, keys: Sequence[Key], on_hint: Callable[[Key], None]) -> None:
        """Tell the policy which hinted keys are resident, as ExpertScheduler.hint does."""
        for key in keys:
            if key in self.resident:
                on_hint(key)

    def prefetch(self, keys: Sequence[Key]) -> None:
        """Load ``keys`` speculatively; those loading are not candidates for eviction. One
        ``ExpertScheduler.prefetch`` call per run of one layer's keys (as
        ``replay_scheduler`` makes them), each skipped while the governor declines."""
        loading: set[Key] = set()  # LOADING in the scheduler: not a candidate
        self.candidates.pinned = loading
        for layer, experts in _by_layer(keys):
            if not self.governor.allows():
                continue
            for expert in experts:
                key = (layer, expert)
                if key in self.resident:
                    continue
                if len(self.resident) >= self.slots:
                    if not len(self.candidates):
                        return
                    self.evict()
                self.resident.add(key)
                loading.add(key)
                self.speculative.add(key)
                self.policy.on_insert(key)
                self.spec_reads += 1


def replay(
    source: KeyStream | Iterable[Request],
    slots: int,
    policy: str | EvictionPolicy = "lru",
    *,
    record_bytes: int = 0,
    hints: bool = False,
    prefetch: bool = False,
    **options: Any,
) -> ReplayResult:
    """Replay the stream through an online ``policy`` (a name from POLICIES, with
    ``options`` for its constructor, or an instance) on a ring of ``slots`` slots.

    ``hints``: after each request, pass the stream's hint keys that are resident to the
    policy's ``on_hint``, as ``ExpertScheduler.hint`` does (see HintablePolicy); the result
    is named "<policy>+hint". ``prefetch``: then load the stream's prefetch keys
    speculatively (module docstring); the name gets "+prefetch"."""
    if policy == "belady":
        return replay_belady(source, slots, record_bytes=record_bytes)
    stream = as_stream(source)
    _check_fits(stream, slots)
    pol = make_policy(policy, **options) if isinstance(policy, str) else policy
    on_hint = getattr(pol, "on_hint", None) if hints else None
    if hints and (on_hint is None or stream.hints is None):
        raise ValueError("hints need a stream with hints and a policy with on_hint()")
    if prefetch and stream.prefetch is None:
        raise ValueError("prefetch needs a stream with prefetch lists")
    hint_lists = stream.hints if on_hint is not None else None
    spec_lists = stream.prefetch if prefetch else None
    ring = _ReplayRing(pol, slots)
    for b, keys in enumerate(stream.batches):
        ring.demand(keys)
        if hint_lists is not None and on_hint is not None:
            ring.hint(hint_lists[b], on_hint)
        if spec_lists is not None and spec_lists[b]:
            ring.prefetch(spec_lists[b])
    hits, spec_reads, spec_used = ring.hits, ring.spec_reads, ring.spec_used
    n = stream.num_requests
    name = pol.name + ("+hint" if hint_lists is not None else "")
    name += "+prefetch" if spec_lists is not None else ""
    misses = n - hits
    return ReplayResult(
        name,
        slots,
        n,
        hits,
        misses,
        (misses + spec_reads) * record_bytes,
        spec_reads,
        spec_used,
    )


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
                victim = _pop_farthest(heap, current, in_batch, b, nkeys)
                current[victim] = -1
                recent.pop(victim, None)
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


def _pop_farthest(
    heap: list[int], current: list[int], in_batch: list[int], b: int, nkeys: int
) -> int:
    """The resident key outside request ``b`` whose next use is farthest, off the heap
    (stale entries dropped, those of keys request ``b`` pins put back)."""
    skipped = []
    while True:
        entry = heapq.heappop(heap)
        use, victim = divmod(-entry, nkeys)
        if current[victim] != use:
            continue  # stale
        if in_batch[victim] == b:
            skipped.append(entry)  # pinned by this request
            continue
        break
    for entry in skipped:
        heapq.heappush(heap, entry)
    return victim


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


def _by_layer(keys: Sequence[Key]) -> list[tuple[int, list[int]]]:
    """Consecutive runs of one layer: the (layer, experts) calls that pass ``keys`` in order."""
    runs: list[tuple[int, list[int]]] = []
    for layer, expert in keys:
        if not runs or runs[-1][0] != layer:
            runs.append((layer, []))
        runs[-1][1].append(expert)
    return runs


def replay_scheduler(
    source: KeyStream | Iterable[Request],
    slots: int,
    policy: str | EvictionPolicy = "lru",
    *,
    record_bytes: int = 0,
    hints: bool = False,
    prefetch: bool = False,
    **options: Any,
) -> ReplayResult:
    """The same replay through the real ``ExpertScheduler`` (acquire, release, one request
    at a time, instant reads): a cross-check of ``replay``. ``hints``: ``hint()`` after each
    request with the stream's hint keys; ``prefetch``: then ``prefetch()`` with its prefetch
    keys, letting those reads finish before the next request. O(slots) per request; for
    small streams."""
    from smoe.sched.scheduler import ExpertScheduler
    from smoe.sched.types import Priority

    stream = as_stream(source)
    if hints and stream.hints is None:
        raise ValueError("hints need a stream with hints")
    if prefetch and stream.prefetch is None:
        raise ValueError("prefetch needs a stream with prefetch lists")
    pol = make_policy(policy, **options) if isinstance(policy, str) else policy

    async def run() -> ExpertScheduler:
        sched = ExpertScheduler(
            slots,
            _InstantBackend(record_bytes),
            record_of=lambda k: k[0] * 1_000_003 + k[1],
            record_bytes=record_bytes,
            policy=pol,
        )
        for i, keys in enumerate(stream.batches):
            if keys:
                got = await sched.acquire(keys[0][0], [e for _, e in keys])
                sched.release(got)
            if hints and stream.hints is not None:
                for layer, experts in _by_layer(stream.hints[i]):
                    sched.hint(layer, experts)
            if prefetch and stream.prefetch is not None:
                for layer, experts in _by_layer(stream.prefetch[i]):
                    sched.prefetch(layer, experts)
                await sched.drain()  # the next request finds them READY
        await sched.close()
        return sched

    sched = asyncio.run(run())
    st = sched.stats
    spec = st.by_priority[Priority.SPECULATIVE].reads
    name = sched.policy.name + ("+hint" if hints else "") + ("+prefetch" if prefetch else "")
    return ReplayResult(
        name,
        slots,
        st.hits + st.misses,
        st.hits,
        st.misses,
        (st.misses + spec) * record_bytes,
        spec,
        st.speculative_used,
    )
