"""`smoe bench policy` / `smoe bench locality`: eviction policies against Belady's optimum on a
routing archive (an engine's, or a synthetic one from smoe.telemetry.traces).

Ring sizes are fractions of the trace's working set (distinct (layer, expert) keys: a ring
that large never evicts). Every policy and Belady replay the same request stream with the
engine's rules (smoe.sched.replay); "vs_belady" is a policy's misses / Belady's misses, so
1.15 means 15% more record reads than the offline optimum. The "hot" policy pins the most
requested keys of the trace itself (hot_share x slots of them): a static pin profiled on
the very trace it is scored on, i.e. an upper bound for a pin learned offline.

Run as a module too (until the CLI is wired):
  python -m smoe.bench.policy --preset qwen3-235b-like --tokens 2200 --seed 1
  python -m smoe.bench.policy /work/data/archives/run.npz --json report.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from smoe.sched.policy import POLICIES, PinnedHot
from smoe.sched.replay import KeyStream, ReplayResult, Request, replay, replay_belady
from smoe.telemetry.archive import RoutingArchive
from smoe.telemetry.locality import headline, locality

DEFAULT_POLICIES = ("lru", "lru-layer", "lfu", "slru", "arc", "hot")


def stream_from_archive(
    archive: RoutingArchive, phase: int | None = None, hint_depth: int = 0
) -> KeyStream:
    """The archive's requests (as ``archive.requests(phase)``: per batch and layer, the
    distinct experts of its tokens' top-k) with, if ``hint_depth`` > top_k, hints: the
    distinct experts of gate ranks top_k .. hint_depth-1 that were not used."""
    k = archive.top_k
    depth = min(hint_depth, archive.depth)
    keep = np.ones(archive.num_tokens, bool) if phase is None else archive.phase == phase
    idx = np.nonzero(keep)[0]
    batches: list[list[tuple[int, int]]] = []
    hints: list[list[tuple[int, int]]] | None = [] if depth > k else None
    if idx.size == 0:
        return KeyStream(batches, hints)
    starts = np.nonzero(np.diff(archive.batch[idx], prepend=archive.batch[idx][0] - 1))[0]
    bounds = [*starts.tolist(), idx.size]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        rows = idx[a:b]
        for pos in range(len(archive.layers)):
            used = np.unique(archive.ranks[rows, pos, :k]).tolist()
            batches.append([(pos, e) for e in used])
            if hints is not None:
                deep = np.unique(archive.ranks[rows, pos, k:depth])
                hints.append([(pos, e) for e in np.setdiff1d(deep, used).tolist()])
    return KeyStream(batches, hints)


def _stream(
    source: RoutingArchive | KeyStream | Iterable[Request], phase: int | None, hint_depth: int
) -> tuple[KeyStream, dict[str, Any]]:
    if isinstance(source, RoutingArchive):
        info = {
            "source": source.meta.get("source", "archive"),
            "tokens": source.num_tokens,
            "layers": len(source.layers),
            "num_experts": source.num_experts,
            "top_k": source.top_k,
        }
        return stream_from_archive(source, phase, hint_depth), info
    stream = source if isinstance(source, KeyStream) else KeyStream.from_requests(source)
    return stream, {"source": "requests"}


def bench_policy(
    source: RoutingArchive | KeyStream | Iterable[Request],
    ring_fractions: Sequence[float] = (0.25, 0.5, 0.75),
    policies: Sequence[str] = DEFAULT_POLICIES,
    *,
    record_bytes: int | None = None,
    phase: int | None = None,
    hot_share: float = 0.5,
    options: dict[str, dict[str, Any]] | None = None,
    hint_depth: int = 0,
    horizons: Sequence[int] = (),
) -> dict[str, Any]:
    """Replay ``source`` (an archive: its requests of ``phase``, None = all) through every
    policy and Belady at each ring size. ``record_bytes`` defaults to the archive's
    meta["record_bytes"] (0 if unknown). ``options[name]`` go to that policy's constructor.
    ``hint_depth`` > top_k (archives only) adds "<policy>+hint" rows for policies with
    ``on_hint``, fed the unused experts of gate ranks top_k .. hint_depth-1. ``horizons``
    (tokens) adds Belady with that much foresight ("belady_horizon" per ring): how much
    future knowledge the optimum's advantage needs.

    Returns a JSON-able dict: {"trace": {...working_set, requests, ...}, "rings": [{"fraction",
    "slots", "belady": result, "policies": {name: result + "vs_belady" + "seconds"}}]}, a
    result being ReplayResult.to_dict() (misses, bytes, hit_rate, ...).
    """
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {sorted(POLICIES)}")
    stream, info = _stream(source, phase, hint_depth)
    if record_bytes is None:
        meta = source.meta if isinstance(source, RoutingArchive) else {}
        record_bytes = int(meta.get("record_bytes", 0))
    counts = stream.counts() if "hot" in policies else {}
    info |= {
        "batches": len(stream.batches),
        "requests": stream.num_requests,
        "working_set": stream.working_set,
        "widest_request": stream.widest,
        "record_bytes": record_bytes,
    }
    rings = []
    for fraction in ring_fractions:
        slots = max(stream.widest, round(fraction * stream.working_set))
        t0 = time.perf_counter()
        best = replay_belady(stream, slots, record_bytes=record_bytes)
        row: dict[str, Any] = {
            "fraction": fraction,
            "slots": slots,
            "belady": best.to_dict() | {"seconds": round(time.perf_counter() - t0, 3)},
            "policies": {},
        }
        for name in policies:
            opts = dict((options or {}).get(name, {}))
            t0 = time.perf_counter()
            if name == "hot" and "hot" not in opts:
                policy = PinnedHot.from_counts(counts, int(hot_share * slots))
                got = replay(stream, slots, policy, record_bytes=record_bytes)
            else:
                got = replay(stream, slots, name, record_bytes=record_bytes, **opts)
            row["policies"][name] = _scored(got, best, t0)
        hintable = [n for n in policies if n != "hot" and hasattr(POLICIES[n](), "on_hint")]
        for name in hintable if stream.hints is not None else []:
            t0 = time.perf_counter()
            got = replay(
                stream,
                slots,
                name,
                record_bytes=record_bytes,
                hints=True,
                **(options or {}).get(name, {}),
            )
            row["policies"][got.policy] = _scored(got, best, t0)
        if horizons:
            per_token = max(1, int(info.get("layers", 1)))
            row["belady_horizon"] = {}
            for h in horizons:
                t0 = time.perf_counter()
                got = replay_belady(stream, slots, horizon=h * per_token)
                row["belady_horizon"][str(h)] = _scored(got, best, t0)
        rings.append(row)
    return {"trace": info, "rings": rings}


def _scored(got: ReplayResult, best: ReplayResult, t0: float) -> dict[str, Any]:
    return got.to_dict() | {
        "vs_belady": round(got.misses / best.misses, 4) if best.misses else None,
        "seconds": round(time.perf_counter() - t0, 3),
    }


def bench_locality(archive: RoutingArchive, **kwargs: Any) -> dict[str, Any]:
    """Locality statistics (smoe.telemetry.locality.locality) plus the headline figures."""
    report = locality(archive, **kwargs)
    report["headline"] = headline(report)
    report["source"] = archive.meta.get("source", "archive")
    return report


def format_table(report: dict[str, Any]) -> str:
    """Markdown: one row per ring size; per policy, misses and misses / Belady's."""
    rings = report["rings"]
    names = list(rings[0]["policies"]) if rings else []
    head = ["ring", "slots", "Belady misses (hit)"] + [f"{n} (x Belady)" for n in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rings:
        b = r["belady"]
        cells = [
            f"{r['fraction']:.0%}",
            f"{r['slots']:,}",
            f"{b['misses']:,} ({b['hit_rate']:.1%})",
        ]
        for n in names:
            p = r["policies"][n]
            ratio = p["vs_belady"]
            cells.append(f"{p['misses']:,} ({ratio:.3f})" if ratio else f"{p['misses']:,}")
        lines.append("| " + " | ".join(cells) + " |")
    horizons = list(rings[0].get("belady_horizon", {})) if rings else []
    if horizons:  # a second table: Belady with limited foresight
        head = ["ring"] + [f"Belady, {h} tokens of foresight (x Belady)" for h in horizons]
        lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rings:
            cells = [f"{r['fraction']:.0%}"] + [
                f"{r['belady_horizon'][h]['misses']:,} ({r['belady_horizon'][h]['vs_belady']:.3f})"
                for h in horizons
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m smoe.bench.policy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("archive", nargs="?", help="routing archive (.npz)")
    ap.add_argument("--preset", help="synthetic trace preset instead of an archive")
    ap.add_argument("--tokens", type=int, default=2200)
    ap.add_argument("--layers", type=int, help="override the preset's layer count")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a preset's TraceParams field (repeatable), e.g. drift_tokens=64",
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rings", default="0.25,0.5,0.75", help="fractions of the working set")
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    ap.add_argument("--phase", choices=["all", "prefill", "decode"], default="all")
    ap.add_argument("--record-bytes", type=int)
    ap.add_argument("--hot-share", type=float, default=0.5)
    ap.add_argument(
        "--hint-depth",
        type=int,
        default=0,
        help="also replay hint-taking policies fed gate ranks top_k..N-1",
    )
    ap.add_argument("--horizons", default="", help="Belady foresight in tokens, e.g. 1,8,64")
    ap.add_argument("--json", help="write the full report here")
    ap.add_argument("--plot", help="write a hit-rate plot (PNG) here")
    ap.add_argument("--locality", action="store_true", help="also print locality figures")
    args = ap.parse_args(argv)
    if (args.archive is None) == (args.preset is None):
        ap.error("give an archive or --preset")
    if args.preset:
        from smoe.telemetry.traces import preset_trace

        fields = dict(item.split("=", 1) for item in args.set)
        overrides = {k: float(v) if "." in v or "e" in v else int(v) for k, v in fields.items()}
        archive = preset_trace(
            args.preset, args.tokens, seed=args.seed, layers=args.layers, **overrides
        )
    else:
        archive = RoutingArchive.load(args.archive)
    phase = {"all": None, "prefill": 0, "decode": 1}[args.phase]
    report = bench_policy(
        archive,
        [float(x) for x in args.rings.split(",")],
        [p for p in args.policies.split(",") if p],
        record_bytes=args.record_bytes,
        phase=phase,
        hot_share=args.hot_share,
        hint_depth=args.hint_depth,
        horizons=[int(x) for x in args.horizons.split(",") if x],
    )
    if args.locality:
        report["locality"] = bench_locality(archive)["headline"]
        print(json.dumps(report["locality"]))
    print(json.dumps(report["trace"]))
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.plot:
        from smoe.bench.plots import plot_hit_rates

        plot_hit_rates(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
