"""`smoe bench tiers`: a two-level expert cache (issue 50) replayed on a routing archive.

The top tier is the ring the engine computes from (GPU memory on CUDA), the second tier is
host RAM, below both is the vault on the SSD. Each requested (layer, expert) key is a
top-tier hit, a second-tier hit (a bus copy host -> GPU) or a miss (a disk read). Sizes are
fractions of the stream's working set (distinct keys; "100%" holds every expert seen).
Requests follow the engine's rules (smoe.telemetry.replay): a request's keys are pinned in
the top tier together, a miss evicts the top policy's victim among the other keys.

Schemes:
- inclusive: the second tier holds a superset of the top tier (second % counts the top's
  keys too, so second >= top). A disk read enters both; a top eviction only drops the GPU
  copy; the second tier evicts among keys not in the top tier (and not pinned by the
  request). Its policy sees every access (top hits too: the engine knows them all).
- exclusive: the tiers hold disjoint keys (together top + second). A disk read enters the
  top tier only; the top's victim is demoted into the second tier; a second-tier hit moves
  the key up (removed from the second tier). The second tier only ever sees demotions, so
  its own "lfu" book is as blind as FIFO; "shared" evicts by the top LFU's remembered
  weights (one frequency book for both tiers, LFU(remember=True) keeps evicted keys').
  Each demotion is a copy GPU -> host ("demotions"), beside the bus copies up.
- kept: exclusive in effect, with fewer copies down. A second-tier hit is copied up and
  its host copy kept; a kept copy of a key the top tier holds is free room (evicted before
  anything else), and demoting a key whose copy is still kept copies nothing.
- landed: no copy down. A disk read lands in a host buffer and is copied up from there, so
  it enters both tiers (as inclusive); a top eviction drops only the GPU copy. The second
  tier evicts, among its unpinned keys, "shared": the least weight in the top LFU's book
  (copies of GPU-resident keys included); "dupfirst": a copy of a GPU-resident key first
  (the one of most weight: the last likely to leave the GPU), else the least weight.

Bounds (Belady's MIN under the same pinning rules, smoe.telemetry.replay.replay_belady):
"belady_top": MIN misses of a ring of the top's size, the fewest top misses (bus copies +
disk reads) any scheme can have; "belady_disk": MIN at top + second slots (exclusive
capacity), the fewest disk reads any two-level cache of that memory can have (an inclusive
one holds fewer distinct keys still). "disk_vs_belady" = disk reads / belady_disk,
"top_vs_belady" = (bus + disk) / belady_top.

  python -m smoe.bench.tiers results/archives/kjv-demo-heldout.npz --json tiers.json
  smoe bench tiers results/archives/kjv-demo-chats.npz --phase decode
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from smoe.sched.policy import LFU, EvictionPolicy, make_policy
from smoe.sched.types import Key
from smoe.telemetry.replay import KeyStream, replay_belady

DEFAULT_PAIRS = ((5, 25), (5, 50), (5, 100), (25, 25), (25, 50))
# (scheme, top policy, second policy)
DEFAULT_SCHEMES = (
    ("inclusive", "lru", "lru"),
    ("inclusive", "lfu", "lru"),
    ("inclusive", "lru", "lfu"),
    ("inclusive", "lfu", "lfu"),
    ("exclusive", "lru", "lru"),
    ("exclusive", "lfu", "lru"),
    ("exclusive", "lru", "lfu"),
    ("exclusive", "lfu", "lfu"),
    ("exclusive", "lfu", "shared"),
    ("kept", "lfu", "shared"),
    ("landed", "lfu", "shared"),
    ("landed", "lfu", "dupfirst"),
)


@dataclass(frozen=True)
class TierCounts:
    """Per requested key: top hits + bus copies + disk reads = requests."""

    requests: int
    top_hits: int
    bus: int  # second-tier hits: copies host -> top tier
    disk: int  # misses of both tiers: records read from the vault
    demotions: int = 0  # exclusive: top-tier victims copied down (GPU -> host)


class _SharedBook:
    """Second-tier policy of exclusive "shared": the victim is the candidate of least
    weight in the top tier's LFU book (which remembers evicted keys)."""

    name = "shared"

    def __init__(self, top: LFU) -> None:
        self.top = top

    def on_insert(self, key: Key) -> None:
        pass

    def on_access(self, key: Key) -> None:
        pass

    def on_remove(self, key: Key) -> None:
        pass

    def victim(self, candidates: Iterable[Key]) -> Key:
        return min(candidates, key=self.top.weight_of)


class _DupFirst(_SharedBook):
    """Second-tier policy of "landed" "dupfirst": a copy of a key the top tier holds goes
    first (of those, the one of most weight), else the least weight (module doc)."""

    name = "dupfirst"

    def __init__(self, top: LFU, in_top: set[Key]) -> None:
        super().__init__(top)
        self.in_top = in_top

    def victim(self, candidates: Iterable[Key]) -> Key:
        cands = list(candidates)
        dups = [k for k in cands if k in self.in_top]
        if not dups:
            return super().victim(cands)
        return max(dups, key=self.top.weight_of)


def _policy(
    name: str, top: EvictionPolicy | None = None, in_top: set[Key] | None = None
) -> EvictionPolicy:
    if name in ("shared", "dupfirst"):
        if not isinstance(top, LFU):
            raise ValueError(f"second policy {name!r} needs an lfu top tier")
        return (
            _SharedBook(top)
            if name == "shared"
            else _DupFirst(top, in_top if in_top is not None else set())
        )
    return make_policy(name)


def simulate(
    stream: KeyStream | Sequence[Sequence[Key]],
    top_slots: int,
    second_slots: int,
    scheme: str = "exclusive",
    top_policy: str | EvictionPolicy = "lru",
    second_policy: str | EvictionPolicy = "lru",
) -> TierCounts:
    """Replay the requests (lists of distinct keys) through the two tiers (module doc)."""
    batches = stream.batches if isinstance(stream, KeyStream) else stream
    if scheme not in ("inclusive", "exclusive", "kept", "landed"):
        raise ValueError(f"scheme {scheme!r}: inclusive, exclusive, kept or landed")
    if scheme == "inclusive" and second_slots < top_slots:
        raise ValueError("an inclusive second tier must be at least as large as the top")
    if max((len(b) for b in batches), default=0) > top_slots:
        raise ValueError("a request pins more keys than the top tier has slots")
    top: set[Key] = set()
    second: set[Key] = set()
    tp = make_policy(top_policy) if isinstance(top_policy, str) else top_policy
    sp = _policy(second_policy, tp, top) if isinstance(second_policy, str) else second_policy
    inclusive = scheme == "inclusive"
    landed = scheme == "landed"
    kept = scheme == "kept"
    requests = top_hits = bus = disk = demotions = 0

    def second_victim(pinned: frozenset[Key]) -> Key:
        if kept and second & top:  # a copy of a key the top holds: free room
            return min(second & top)
        base = second - top if inclusive else second
        cands = base - pinned or base
        out = sp.victim(cands)
        if out not in cands:
            raise AssertionError(f"second-tier policy chose {out}, not a candidate")
        return out

    def second_drop(key: Key) -> None:
        second.discard(key)
        sp.on_remove(key)

    for keys in batches:
        pinned = frozenset(keys)
        for key in keys:
            requests += 1
            if key in top:
                top_hits += 1
                tp.on_access(key)
                if inclusive or landed:
                    sp.on_access(key)
                continue
            demoted: Key | None = None
            if len(top) >= top_slots:  # make room in the top tier
                demoted = tp.victim(top - pinned)
                top.remove(demoted)
                tp.on_remove(demoted)
            if key in second:
                bus += 1
                if inclusive or landed:
                    sp.on_access(key)
                elif not kept:  # moves up
                    second_drop(key)
            else:
                disk += 1
                if (inclusive or landed) and second_slots > 0:
                    if len(second) >= second_slots:
                        second_drop(second_victim(pinned))
                    second.add(key)
                    sp.on_insert(key)
                    sp.on_access(key)
            if demoted is not None and kept and demoted in second:
                pass  # its copy is still kept: nothing moves
            elif demoted is not None and scheme in ("exclusive", "kept") and second_slots > 0:
                if len(second) >= second_slots:
                    second_drop(second_victim(pinned))
                second.add(demoted)
                sp.on_insert(demoted)
                demotions += 1
            top.add(key)
            tp.on_insert(key)
            tp.on_access(key)
    return TierCounts(requests, top_hits, bus, disk, demotions)


def bench_tiers(
    stream: KeyStream,
    tokens: int,
    pairs: Sequence[tuple[float, float]] = DEFAULT_PAIRS,
    schemes: Sequence[tuple[str, str, str]] = DEFAULT_SCHEMES,
) -> dict[str, Any]:
    """Every scheme at every (top %, second %) pair, per token, against the bounds."""
    ws = stream.working_set

    def slots(pct: float) -> int:
        return max(stream.widest, round(pct / 100 * ws))

    rows = []
    for top_pct, second_pct in pairs:
        t, s = slots(top_pct), round(second_pct / 100 * ws)
        b_top = replay_belady(stream, t).misses
        b_disk = replay_belady(stream, t + s).misses
        b_incl = replay_belady(stream, max(t, s)).misses
        row: dict[str, Any] = {
            "top_pct": top_pct,
            "second_pct": second_pct,
            "top_slots": t,
            "second_slots": s,
            "belady_top_per_token": round(b_top / tokens, 4),
            "belady_disk_per_token": round(b_disk / tokens, 4),
            "belady_inclusive_disk_per_token": round(b_incl / tokens, 4),
            "schemes": {},
        }
        for scheme, tpol, spol in schemes:
            if scheme == "inclusive" and s < t:
                continue
            c = simulate(stream, t, s, scheme, tpol, spol)
            row["schemes"][f"{scheme} {tpol}/{spol}"] = asdict(c) | {
                "disk_per_token": round(c.disk / tokens, 4),
                "bus_per_token": round(c.bus / tokens, 4),
                "demotions_per_token": round(c.demotions / tokens, 4),
                "disk_vs_belady": round(c.disk / b_disk, 4) if b_disk else None,
                "top_vs_belady": round((c.bus + c.disk) / b_top, 4) if b_top else None,
            }
        rows.append(row)
    info = {
        "tokens": tokens,
        "requests": stream.num_requests,
        "working_set": ws,
        "widest_request": stream.widest,
    }
    return {"trace": info, "pairs": rows}


def format_table(report: dict[str, Any]) -> str:
    """Markdown: one row per (pair, scheme): disk reads and bus copies per token, ratios."""
    head = [
        "top / second",
        "scheme top/second policy",
        "disk reads/token (x Belady)",
        "bus copies/token",
        "top misses x Belady(top)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["pairs"]:
        pair = f"{r['top_pct']}% ({r['top_slots']}) / {r['second_pct']}% ({r['second_slots']})"
        lines.append(
            f"| {pair} | Belady bound | {r['belady_disk_per_token']:.3f} (1.000) | - | "
            f"{r['belady_top_per_token']:.3f}/token |"
        )
        for name, c in r["schemes"].items():
            lines.append(
                f"| {pair} | {name} | {c['disk_per_token']:.3f} ({c['disk_vs_belady']:.3f}) | "
                f"{c['bus_per_token']:.3f} | {c['top_vs_belady']:.3f} |"
            )
    return "\n".join(lines)


def _pairs(text: str) -> list[tuple[float, float]]:
    out = []
    for item in text.split(","):
        a, _, b = item.partition("/")
        out.append((float(a), float(b)))
    return out


def main(argv: Sequence[str] | None = None, prog: str = "python -m smoe.bench.tiers") -> int:
    from smoe.bench.policy import stream_from_archive
    from smoe.telemetry.archive import RoutingArchive

    ap = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("archive", help="routing archive (.npz)")
    ap.add_argument(
        "--pairs",
        default=",".join(f"{a}/{b}" for a, b in DEFAULT_PAIRS),
        help="top%%/second%% pairs, shares of the working set (default "
        + ",".join(f"{a}/{b}" for a, b in DEFAULT_PAIRS)
        + ")",
    )
    ap.add_argument(
        "--phase",
        choices=["all", "prefill", "decode"],
        default="all",
        help="the requests replayed (default all)",
    )
    ap.add_argument("--json", help="write the full report here (default: none)")
    args = ap.parse_args(argv)
    archive = RoutingArchive.load(args.archive)
    phase = {"all": None, "prefill": 0, "decode": 1}[args.phase]
    stream = stream_from_archive(archive, phase)
    tokens = archive.num_tokens if phase is None else int((archive.phase == phase).sum())
    report = bench_tiers(stream, tokens, _pairs(args.pairs))
    report["trace"] |= {"source": str(args.archive), "phase": args.phase}
    print(json.dumps(report, indent=1))
    print(format_table(report), file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
