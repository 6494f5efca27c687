"""Routing archive: every (token, MoE layer) routing decision with its gate ranking.

Stored as a compressed .npz (numpy only, so the policy tools read it anywhere):
  ranks  uint16 [N, L, R]  expert ids by descending gate score; ranks[..., :top_k] were used
  batch  int32  [N]        tokens with the same id were routed together (one prefill chunk,
                           or one decode step): a replay requests their union per layer
  phase  uint8  [N]        0 = prefill, 1 = decode
  layers int32  [L]        the decoder layer of each MoE layer
  meta   JSON string       num_experts, top_k, depth R, source, ...
  ahead  uint16 [N, L, A]  optional (archives recorded since issue 14): the lookahead, i.e.
                           MoE layer l's router run on MoE layer l-1's input (what the
                           engine's lookahead prefetches from), expert ids by descending
                           score; NO_EXPERT (65535) where nothing was predicted (the first
                           MoE layer, routers that return only their top-k)
N tokens in processing order. Written atomically (temp name, fsync, rename). Archives
without ``ahead`` load with ``ahead = None``; readers that predate it ignore it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from smoe.util.files import atomic_write, sweep_stale

PREFILL, DECODE = 0, 1
NO_EXPERT = 0xFFFF  # an empty place in ``ahead``


@dataclass
class RoutingArchive:
    num_experts: int
    top_k: int
    layers: list[int]
    ranks: np.ndarray  # uint16 [N, L, R]
    batch: np.ndarray  # int32 [N]
    phase: np.ndarray  # uint8 [N]
    meta: dict[str, Any] = field(default_factory=dict)
    ahead: np.ndarray | None = None  # uint16 [N, L, A]: the lookahead (module docstring)

    @property
    def depth(self) -> int:
        return int(self.ranks.shape[2])

    @property
    def num_tokens(self) -> int:
        return int(self.ranks.shape[0])

    def requests(self, phase: int | None = None) -> list[tuple[int, list[int]]]:
        """(layer position, sorted distinct experts) per (batch, layer), in order: what the
        engine asks the scheduler for."""
        out: list[tuple[int, list[int]]] = []
        keep = np.ones(self.num_tokens, bool) if phase is None else self.phase == phase
        idx = np.nonzero(keep)[0]
        if idx.size == 0:
            return out
        starts = np.nonzero(np.diff(self.batch[idx], prepend=self.batch[idx][0] - 1))[0]
        bounds = list(starts) + [idx.size]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            rows = idx[a:b]
            for pos in range(len(self.layers)):
                experts = np.unique(self.ranks[rows, pos, : self.top_k])
                out.append((pos, experts.tolist()))
        return out

    def save(self, path: str | Path) -> Path:
        """Write the archive to ``path`` (".npz" appended if missing) atomically: readers see
        the old file or the whole new one. Raises SmoeError if it cannot be written (the old
        file then stays)."""
        path = Path(path)
        if path.suffix != ".npz":
            path = path.with_name(path.name + ".npz")
        meta = {
            **self.meta,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "format": "smoe-routing-1",
        }
        sweep_stale(path.parent, targets=[path.name])  # saves of this file killed before
        try:
            with atomic_write(path, keep_suffix=True) as f:  # .NAME.tmp-PID.npz
                extra = {} if self.ahead is None else {"ahead": self.ahead.astype(np.uint16)}
                np.savez_compressed(
                    f,
                    ranks=self.ranks.astype(np.uint16),
                    batch=self.batch,
                    phase=self.phase,
                    layers=np.asarray(self.layers, np.int32),
                    meta=np.array(json.dumps(meta)),
                    **extra,
                )
        except OSError as e:
            from smoe.errors import SmoeError

            raise SmoeError(
                f"cannot write routing archive {path} ({e}); check that the directory "
                "exists and has space"
            ) from None
        return path

    @classmethod
    def load(cls, path: str | Path) -> RoutingArchive:
        """Read an archive written by ``save``. Raises SmoeError if the file is missing,
        truncated, not an npz or not a routing archive."""
        from smoe.errors import SmoeError

        try:  # our own handle: np.load leaks its file when the zip is bad
            with open(path, "rb") as f, np.load(f, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                if meta.get("format") != "smoe-routing-1":
                    raise SmoeError(f"{path} is not an S-MoE routing archive")
                return cls(
                    int(meta["num_experts"]),
                    int(meta["top_k"]),
                    z["layers"].tolist(),
                    z["ranks"],
                    z["batch"],
                    z["phase"],
                    meta,
                    ahead=z["ahead"] if "ahead" in z.files else None,
                )
        except SmoeError:
            raise
        except Exception as e:  # BadZipFile, EOFError, zlib.error, OSError, KeyError...
            raise SmoeError(f"cannot read routing archive {path} ({e})") from None


class ArchiveRecorder:
    """Collects routing from the compute thread; ``archive()`` assembles the file's arrays.

    ``record`` takes each MoE layer's gate ranking; ``record_ahead`` the lookahead ranking
    of the next MoE layer (kept to the same depth; the archive has ``ahead`` once any was
    recorded)."""

    def __init__(self, num_experts: int, top_k: int, layers: list[int], depth: int) -> None:
        self.num_experts, self.top_k, self.layers = num_experts, top_k, layers
        self.depth = min(depth, num_experts)
        self._pos = {layer: i for i, layer in enumerate(layers)}
        self._rows: list[np.ndarray] = []  # per batch: [T, L, R]
        self._ahead: list[np.ndarray] = []  # per batch: [T, L, R], NO_EXPERT where none
        self._any_ahead = False
        self._phases: list[int] = []
        self._phase = PREFILL

    def begin(self, tokens: int, phase: int) -> int:
        """A new batch of ``tokens`` tokens (a prefill chunk or a decode step) starts;
        returns its number, for ``record`` where several batches are under way at once
        (the chunks of a layer-major prefill each record into their own)."""
        shape = (tokens, len(self.layers), self.depth)
        self._rows.append(np.zeros(shape, np.uint16))
        self._ahead.append(np.full(shape, NO_EXPERT, np.uint16))
        self._phases.append(phase)
        return len(self._rows) - 1

    def _batch(self, rows: list[np.ndarray], batch: int | None) -> np.ndarray | None:
        if not rows:
            return None
        return rows[-1] if batch is None else rows[batch]

    def record(self, layer: int, ranking: np.ndarray, batch: int | None = None) -> None:
        """``ranking`` [T, >=R]: batch ``batch``'s (default: the newest's) expert ids by
        descending gate score."""
        current = self._batch(self._rows, batch)
        if current is not None and ranking.shape[0] == current.shape[0]:
            current[:, self._pos[layer], :] = ranking[:, : self.depth]

    def record_ahead(self, layer: int, ranking: np.ndarray, batch: int | None = None) -> None:
        """``ranking`` [T, n]: ``layer``'s experts by descending score of its router run on
        the previous MoE layer's input (this batch's tokens); places beyond n stay empty."""
        ahead = self._batch(self._ahead, batch)
        if ahead is not None and ranking.shape[0] == ahead.shape[0] and layer in self._pos:
            n = min(ranking.shape[1], self.depth)
            ahead[:, self._pos[layer], :n] = ranking[:, :n]
            self._any_ahead = True

    def archive(self, meta: dict[str, Any] | None = None) -> RoutingArchive:
        if not self._rows:
            ranks = np.zeros((0, len(self.layers), self.depth), np.uint16)
            return RoutingArchive(
                self.num_experts,
                self.top_k,
                self.layers,
                ranks,
                np.zeros(0, np.int32),
                np.zeros(0, np.uint8),
                meta or {},
            )
        ranks = np.concatenate(self._rows)
        batch = np.concatenate([np.full(len(r), i, np.int32) for i, r in enumerate(self._rows)])
        phase = np.concatenate(
            [np.full(len(r), p, np.uint8) for r, p in zip(self._rows, self._phases, strict=True)]
        )
        ahead = np.concatenate(self._ahead) if self._any_ahead else None
        return RoutingArchive(
            self.num_experts, self.top_k, self.layers, ranks, batch, phase, meta or {}, ahead
        )
