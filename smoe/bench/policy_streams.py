"""The request stream `smoe bench policy` replays (smoe.bench.policy): a routing archive's
requests as a KeyStream (smoe.telemetry.replay), with the hints and prefetch lists the
engine's foresight would give after each request (``foresight_from_archive``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from smoe.sched.hints import runner_ups
from smoe.telemetry.archive import DECODE, NO_EXPERT, RoutingArchive
from smoe.telemetry.replay import KeyStream, Request

Keys = list[list[tuple[int, int]]]  # per request, the (layer, expert) keys


def stream_from_archive(
    archive: RoutingArchive, phase: int | None = None, hint_depth: int = 0
) -> KeyStream:
    """The archive's requests (as ``archive.requests(phase)``: per batch and layer, the
    distinct experts of its tokens' top-k) with, if ``hint_depth`` > top_k, hints: the
    distinct experts of gate ranks top_k .. hint_depth-1 that were not used, as the engine
    passes them (``smoe.sched.hints.runner_ups``)."""
    stream, _ = foresight_from_archive(archive, phase, hint_depth)
    return stream


def foresight_from_archive(
    archive: RoutingArchive,
    phase: int | None = None,
    hint_depth: int = 0,
    *,
    lookahead: bool = False,
    echo: int = 0,
    prefill_as_decode: bool = False,
) -> tuple[KeyStream, dict[str, Keys]]:
    """``stream_from_archive``'s stream, and per request the keys the engine would prefetch
    right after it: "lookahead" (if asked and the archive records it): in decode batches,
    the distinct top-k of the next MoE layer's lookahead ranking over the batch's tokens;
    "echo" (``echo`` > 0): in one-token decode batches, gate ranks top_k..top_k+echo-1 of
    the same layer (for the next token). Each list is aligned with the stream's requests.
    ``prefill_as_decode``: one-token prefill batches count as decode steps too (an archive
    of held-out text recorded teacher-forced with prefill_chunk=1)."""
    k = archive.top_k
    depth = min(hint_depth, archive.depth)
    keep = np.ones(archive.num_tokens, bool) if phase is None else archive.phase == phase
    idx = np.nonzero(keep)[0]
    batches: Keys = []
    hints: Keys | None = [] if depth > k else None
    ahead = archive.ahead if lookahead else None
    spec: dict[str, Keys] = {}
    if ahead is not None:
        spec["lookahead"] = []
    if echo > 0:
        spec["echo"] = []
    layers = len(archive.layers)
    if idx.size == 0:
        return KeyStream(batches, hints), spec
    starts = np.nonzero(np.diff(archive.batch[idx], prepend=archive.batch[idx][0] - 1))[0]
    bounds = [*starts.tolist(), idx.size]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        rows = idx[a:b]
        decode = bool(archive.phase[rows[0]] == DECODE) or (prefill_as_decode and b - a == 1)
        for pos in range(layers):
            used = np.unique(archive.ranks[rows, pos, :k]).tolist()
            batches.append([(pos, e) for e in used])
            if hints is not None:
                hints.append([(pos, e) for e in runner_ups(archive.ranks[rows, pos], k, depth)])
            if "echo" in spec:
                bets: Any = (
                    archive.ranks[rows[0], pos, k : k + echo] if decode and b - a == 1 else []
                )
                spec["echo"].append([(pos, int(e)) for e in bets])
            if ahead is not None:
                guess: Any = ahead[rows, pos + 1, :k] if decode and pos + 1 < layers else []
                top = np.unique(np.asarray(guess, np.int64))
                spec["lookahead"].append([(pos + 1, int(e)) for e in top if e != NO_EXPERT])
    return KeyStream(batches, hints), spec


def keys_and_info(
    source: RoutingArchive | KeyStream | Iterable[Request],
    phase: int | None,
    hint_depth: int,
    lookahead: bool,
    echo: int,
    prefill_as_decode: bool,
) -> tuple[KeyStream, dict[str, Keys], dict[str, Any]]:
    """``source`` as a key stream, its prefetch lists (``foresight_from_archive``; archives
    only) and what the report says of the trace (``info``: its shape and the options)."""
    if isinstance(source, RoutingArchive):
        info: dict[str, Any] = {
            "source": source.meta.get("source", "archive"),
            "tokens": source.num_tokens,
            "layers": len(source.layers),
            "num_experts": source.num_experts,
            "top_k": source.top_k,
            "depth": source.depth,
        }
        if hint_depth:
            info["hint_depth"] = min(hint_depth, source.depth)
        if echo:
            info["echo"] = min(echo, source.depth - source.top_k)
        if lookahead:
            info["lookahead"] = (
                "recorded"
                if source.ahead is not None
                else "not in this archive (record it again with this version)"
            )
        if prefill_as_decode:
            info["prefill_as_decode"] = True
        stream, spec = foresight_from_archive(
            source,
            phase,
            hint_depth,
            lookahead=lookahead,
            echo=echo,
            prefill_as_decode=prefill_as_decode,
        )
        return stream, spec, info
    stream = source if isinstance(source, KeyStream) else KeyStream.from_requests(source)
    return stream, {}, {"source": "requests"}
