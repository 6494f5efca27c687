"""Router hints: the experts a router ranked just below the ones it used.

The router scores every expert; the engine uses the top-k and, with a hint-taking policy
("lru+hint", "lfu+hint", "lru-layer+hint"), passes the resident experts of gate ranks
top_k .. hint_depth-1 to ``ExpertScheduler.hint`` after each request, which refreshes them
in the policy (``HintablePolicy.on_hint``) so that eviction takes them later. Only the
eviction order changes, never what is computed.

One function (``runner_ups``) turns a ranking into the hint list, for the engine at route
time and for the replay of a routing archive (``smoe.bench.policy_streams.stream_from_archive``),
so a live run and its offline replay pass the same keys in the same order. No MLX here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

HINT_SUFFIX = "+hint"
HINT_DEPTH_PER_K = 4  # default depth: gate ranks top_k .. 4 x top_k - 1 (9-32 for top-8)


def split_policy_name(name: str) -> tuple[str, bool]:
    """("lru", True) for "lru+hint"; (name, False) for a name without the suffix."""
    if name.endswith(HINT_SUFFIX):
        return name[: -len(HINT_SUFFIX)], True
    return name, False


def takes_hints(policy: Any) -> bool:
    """Whether ``policy`` (an instance) implements ``on_hint``."""
    return callable(getattr(policy, "on_hint", None))


def default_hint_depth(top_k: int, num_experts: int) -> int:
    """Gate ranks a hint reaches by default: 4 x top_k, at most every expert."""
    return min(num_experts, HINT_DEPTH_PER_K * top_k)


def runner_ups(ranking: np.ndarray, top_k: int, depth: int) -> list[int]:
    """The hint of one request: the distinct experts at gate ranks top_k .. depth-1 of any
    of its tokens that none of its tokens used, in ascending expert id.

    ``ranking``: int [T, >= depth] (or [T, L, R] sliced to one layer by the caller): each
    token's expert ids, the used ones first, then the rest by descending gate score, as
    ``smoe.compute.speculation.gate_ranking`` and routing archives store them."""
    rows = np.asarray(ranking).reshape(-1, np.asarray(ranking).shape[-1])
    if depth <= top_k or rows.size == 0:
        return []
    used = np.unique(rows[:, :top_k])
    deep = np.unique(rows[:, top_k:depth])
    return [int(e) for e in np.setdiff1d(deep, used, assume_unique=True)]
