"""`smoe bench policy` / `smoe bench locality`: eviction policies against Belady's optimum on a
routing archive (an engine's, or a synthetic one from smoe.telemetry.traces).

Ring sizes are fractions of the trace's working set (distinct (layer, expert) keys: a ring
that large never evicts). Every policy and Belady replay the same request stream with the
engine's rules (smoe.telemetry.replay); "vs_belady" is a policy's misses / Belady's misses, so
1.15 means 15% more record reads than the offline optimum. The "hot" policy pins the most
requested keys of the trace itself (hot_share x slots of them): a static pin profiled on
the very trace it is scored on, i.e. an upper bound for a pin learned offline.

The foresight the engine really has, as extra lines (each against Belady and the plain
policies; docs/cache-policy.md):
- "<policy>+hint" (--hint-depth N): eviction fed the router's near misses, the unused
  experts of gate ranks top_k..N-1 (the engine's "+hint" policies, ExpertScheduler.hint);
- "<policy>+lookahead" (--lookahead): after each decode request at MoE layer l, the top-k
  of layer l+1's router run on layer l's input is prefetched (the engine's lookahead; needs
  an archive that records it, ``RoutingArchive.ahead``);
- "<policy>+echo" (--echo N): after each one-token decode request, its gate ranks
  top_k..top_k+N-1 at the same layer are prefetched for the next token (gate echo, spec=N);
- "<policy>+hint+lookahead": the hints and the lookahead together (the engine's
  "--policy lru+hint" with lookahead on, its default).
Prefetch lines count demand misses (what a computation waits for) and speculative reads
apart: "vs_belady" is demand misses / Belady's, "reads_vs_belady" all reads / Belady's.
--foresight turns on all of them (hint depth 4 x top_k, echo top_k).

Also ``smoe bench policy ARGS``; run as a module too:
  python -m smoe.bench.policy --preset qwen3-235b-like --tokens 2200 --seed 1
  python -m smoe.bench.policy /work/data/archives/run.npz --foresight --json report.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from smoe.bench.policy_streams import Keys, keys_and_info
from smoe.bench.policy_streams import foresight_from_archive as foresight_from_archive
from smoe.bench.policy_streams import stream_from_archive as stream_from_archive
from smoe.bench.policy_table import format_table
from smoe.errors import SmoeError
from smoe.sched.hints import default_hint_depth, takes_hints
from smoe.sched.policy import POLICIES, PinnedHot
from smoe.telemetry.archive import DECODE, RoutingArchive
from smoe.telemetry.locality import headline, locality
from smoe.telemetry.replay import KeyStream, ReplayResult, Request, replay, replay_belady

DEFAULT_POLICIES = ("lru", "lru-layer", "lfu", "slru", "arc", "hot")
FORESIGHT_POLICIES = ("lru", "lfu")  # bases of the prefetch lines


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
    lookahead: bool = False,
    echo: int = 0,
    foresight_policies: Sequence[str] = FORESIGHT_POLICIES,
    prefill_as_decode: bool = False,
) -> dict[str, Any]:
    """Replay ``source`` (an archive: its requests of ``phase``, None = all) through every
    policy and Belady at each ring size. ``record_bytes`` defaults to the archive's
    meta["record_bytes"] (0 if unknown). ``options[name]`` go to that policy's constructor.
    ``hint_depth`` > top_k (archives only) adds "<policy>+hint" rows for policies with
    ``on_hint``, fed the unused experts of gate ranks top_k .. hint_depth-1. ``horizons``
    (tokens) adds Belady with that much foresight ("belady_horizon" per ring): how much
    future knowledge the optimum's advantage needs.

    Prefetch lines (archives only; "foresight" per ring), for each of
    ``foresight_policies``: "<p>+lookahead" with ``lookahead`` (if the archive records it),
    "<p>+echo" with ``echo`` > 0 (gate ranks top_k..top_k+echo-1), and "<p>+hint+lookahead"
    when hints and the lookahead are both there (``prefill_as_decode``: see
    ``foresight_from_archive``). Each has "vs_belady" (demand misses /
    Belady's), "reads_vs_belady" (demand + speculative reads / Belady's misses) and
    "vs_policy" (demand misses / the plain policy's misses).

    Returns a JSON-able dict: {"trace": {...working_set, requests, ...}, "rings": [{"fraction",
    "slots", "belady": result, "policies": {name: result + "vs_belady" + "seconds"},
    "foresight": {name: ...}}]}, a result being ReplayResult.to_dict() (misses, reads,
    spec_reads, spec_used, bytes, hit_rate, ...).
    """
    unknown = [p for p in (*policies, *foresight_policies) if p not in POLICIES]
    if unknown:
        raise SmoeError(f"unknown policies {unknown}; choose from {', '.join(sorted(POLICIES))}")
    stream, spec, info = keys_and_info(
        source, phase, hint_depth, lookahead, echo, prefill_as_decode
    )
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
        }
        row["policies"] = _policy_rows(
            stream, slots, best, policies, options or {}, counts, hot_share, record_bytes
        )
        if spec:
            row["foresight"] = _foresight(
                stream, spec, slots, best, foresight_policies, record_bytes, options or {}
            )
        if horizons:
            per_token = max(1, int(info.get("layers", 1)))
            row["belady_horizon"] = {}
            for h in horizons:
                t0 = time.perf_counter()
                got = replay_belady(stream, slots, horizon=h * per_token)
                row["belady_horizon"][str(h)] = _scored(got, best, t0)
        rings.append(row)
    return {"trace": info, "rings": rings}


def _policy_rows(
    stream: KeyStream,
    slots: int,
    best: ReplayResult,
    policies: Sequence[str],
    options: dict[str, dict[str, Any]],
    counts: Any,
    hot_share: float,
    record_bytes: int,
) -> dict[str, Any]:
    """Each policy replayed at ``slots`` (and, where the stream has hints, each policy
    that takes them, as "<policy>+hint"), scored against Belady's ``best``."""
    rows: dict[str, Any] = {}
    for name in policies:
        opts = dict(options.get(name, {}))
        t0 = time.perf_counter()
        if name == "hot" and "hot" not in opts:
            policy = PinnedHot.from_counts(counts, int(hot_share * slots))
            got = replay(stream, slots, policy, record_bytes=record_bytes)
        else:
            got = replay(stream, slots, name, record_bytes=record_bytes, **opts)
        rows[name] = _scored(got, best, t0)
    hintable = [n for n in policies if n != "hot" and takes_hints(POLICIES[n]())]
    for name in hintable if stream.hints is not None else []:
        t0 = time.perf_counter()
        got = replay(
            stream, slots, name, record_bytes=record_bytes, hints=True, **options.get(name, {})
        )
        rows[got.policy] = _scored(got, best, t0)
    return rows


def _scored(got: ReplayResult, best: ReplayResult, t0: float) -> dict[str, Any]:
    return got.to_dict() | {
        "vs_belady": round(got.misses / best.misses, 4) if best.misses else None,
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _foresight(
    stream: KeyStream,
    spec: dict[str, Keys],
    slots: int,
    best: ReplayResult,
    bases: Sequence[str],
    record_bytes: int,
    options: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The prefetch lines of one ring (see ``bench_policy``)."""
    lines: list[tuple[str, str, Keys, bool]] = []  # (line, base, prefetch lists, hints)
    for base in bases:
        for kind in ("lookahead", "echo"):
            if kind in spec:
                lines.append((f"{base}+{kind}", base, spec[kind], False))
        if "lookahead" in spec and stream.hints is not None and takes_hints(POLICIES[base]()):
            lines.append((f"{base}+hint+lookahead", base, spec["lookahead"], True))
    out: dict[str, Any] = {}
    plain: dict[str, int] = {}
    for line, base, lists, hinted in lines:
        opts = options.get(base, {})
        if base not in plain:
            plain[base] = replay(stream, slots, base, **opts).misses
        t0 = time.perf_counter()
        got = replay(
            stream.with_foresight(stream.hints, lists),
            slots,
            base,
            record_bytes=record_bytes,
            hints=hinted,
            prefetch=True,
            **opts,
        )
        scored = _scored(got, best, t0) | {"policy": line}
        scored["reads_vs_belady"] = round(got.reads / best.misses, 4) if best.misses else None
        scored["vs_policy"] = round(got.misses / plain[base], 4) if plain[base] else None
        out[line] = scored
    return out


def bench_locality(archive: RoutingArchive, **kwargs: Any) -> dict[str, Any]:
    """Locality statistics (smoe.telemetry.locality.locality) plus the headline figures."""
    report = locality(archive, **kwargs)
    report["headline"] = headline(report)
    report["source"] = archive.meta.get("source", "archive")
    return report


def build_parser(prog: str) -> argparse.ArgumentParser:
    """The options of `smoe bench policy`: one block of declarations, long only by count."""
    ap = argparse.ArgumentParser(
        prog=prog,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "archive", nargs="?", help="routing archive (.npz; no default: this or --preset)"
    )
    ap.add_argument(
        "--preset",
        help="synthetic trace preset (smoe.telemetry.traces) instead of an archive (default: none)",
    )
    ap.add_argument(
        "--tokens", type=int, default=2200, help="with --preset: tokens traced (default 2200)"
    )
    ap.add_argument(
        "--layers", type=int, help="override the preset's layer count (default: the preset's)"
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a preset's TraceParams field (repeatable), e.g. drift_tokens=64 "
        "(default: none)",
    )
    ap.add_argument("--seed", type=int, default=1, help="seed of the trace (default 1)")
    ap.add_argument(
        "--rings",
        default="0.25,0.5,0.75",
        help="ring sizes, as fractions of the working set (default 0.25,0.5,0.75)",
    )
    ap.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help=f"policies replayed (default {','.join(DEFAULT_POLICIES)})",
    )
    ap.add_argument(
        "--phase",
        choices=["all", "prefill", "decode"],
        default="all",
        help="the requests replayed (default all)",
    )
    ap.add_argument(
        "--record-bytes",
        type=int,
        help="bytes per read, for the bytes figures (default: the archive's, else 0)",
    )
    ap.add_argument(
        "--hot-share",
        type=float,
        default=0.5,
        help="share of the ring the hot policy pins (default 0.5)",
    )
    ap.add_argument(
        "--hint-depth",
        type=int,
        default=0,
        help="also replay hint-taking policies fed gate ranks top_k..N-1 (default 0: none)",
    )
    ap.add_argument(
        "--lookahead",
        action="store_true",
        help="prefetch lines: the next MoE layer's router on this layer's input (decode; "
        "needs an archive that records it)",
    )
    ap.add_argument(
        "--echo",
        type=int,
        default=0,
        help="prefetch lines: gate ranks top_k..top_k+N-1 for the next token (decode; "
        "default 0: none)",
    )
    ap.add_argument(
        "--foresight",
        action="store_true",
        help="all of the engine's foresight: --lookahead, --echo top_k and --hint-depth "
        "4 x top_k (where not given)",
    )
    ap.add_argument(
        "--prefill-as-decode",
        action="store_true",
        help="prefetch in one-token prefill batches too (an archive of held-out text "
        "recorded with --prefill-chunk 1)",
    )
    ap.add_argument(
        "--foresight-policies",
        default=",".join(FORESIGHT_POLICIES),
        help=f"policies the prefetch lines run on (default {','.join(FORESIGHT_POLICIES)})",
    )
    ap.add_argument(
        "--horizons",
        default="",
        help="also replay Belady with only this many tokens of foresight, e.g. 1,8,64 "
        "(default: none)",
    )
    ap.add_argument("--json", help="write the full report here (default: none)")
    ap.add_argument("--plot", help="write a hit-rate plot (PNG) here (default: none)")
    ap.add_argument("--locality", action="store_true", help="also print locality figures")
    return ap


def _source(ap: argparse.ArgumentParser, args: argparse.Namespace) -> RoutingArchive:
    """The archive named, or the synthetic trace of ``--preset`` with its ``--set`` fields."""
    if (args.archive is None) == (args.preset is None):
        ap.error("give an archive or --preset")
    if args.preset:
        from smoe.telemetry.traces import preset_trace

        overrides = {}
        for item in args.set:
            key, _, value = item.partition("=")
            try:
                overrides[key] = float(value) if "." in value or "e" in value else int(value)
            except ValueError:
                ap.error(f"--set {item}: give FIELD=NUMBER, e.g. drift_tokens=64")
        return preset_trace(
            args.preset, args.tokens, seed=args.seed, layers=args.layers, **overrides
        )
    return RoutingArchive.load(args.archive)


def main(argv: Sequence[str] | None = None, prog: str = "python -m smoe.bench.policy") -> int:
    ap = build_parser(prog)
    args = ap.parse_args(argv)
    archive = _source(ap, args)
    phase = {"all": None, "prefill": 0, "decode": 1}[args.phase]
    if args.foresight:
        args.lookahead = True
        args.echo = args.echo or archive.top_k
        args.hint_depth = args.hint_depth or default_hint_depth(archive.top_k, archive.num_experts)
    report = bench_policy(
        archive,
        [float(x) for x in args.rings.split(",")],
        [p for p in args.policies.split(",") if p],
        record_bytes=args.record_bytes,
        phase=phase,
        hot_share=args.hot_share,
        hint_depth=args.hint_depth,
        horizons=[int(x) for x in args.horizons.split(",") if x],
        lookahead=args.lookahead,
        echo=args.echo,
        foresight_policies=[p for p in args.foresight_policies.split(",") if p],
        prefill_as_decode=args.prefill_as_decode,
    )
    if args.locality:
        every = args.prefill_as_decode  # held-out text: its prompt tokens are the run
        report["locality"] = bench_locality(archive, phase=None if every else DECODE)["headline"]
        print(json.dumps(report["locality"]))
    print(json.dumps(report["trace"]))
    print(format_table(report), file=sys.stderr)  # stdout is JSON lines, for scripts
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.plot:
        from smoe.bench.plots import plot_hit_rates

        plot_hit_rates(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
