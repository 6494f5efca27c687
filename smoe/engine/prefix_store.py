"""Prefix caches on disk: the keys and values of a server's long prompts, kept across
restarts, so that a repeated long system prompt is not prefilled again.

Each entry is one file, ``<key>.safetensors``: mlx-lm's prompt-cache layout
(``save_prompt_cache``) whose metadata holds ``format``, ``vault`` (the weights'
fingerprint, conversation_file), ``model_type``, ``kv_bits``, ``tokens`` (the ids whose keys
and values it holds), ``cached`` and ``digest`` (xxh3-128 of the fields and of every KV
array's bytes). ``key`` is xxh3-128 of the fingerprint, kv_bits and tokens.

Files on disk are untrusted. At ``open`` every entry's header is checked; one from
another model or KV precision is left alone (the directory may serve several vaults), an
unreadable one is ignored; one warning counts both. A damaged entry found at load (its
digest, its arrays) is ignored with one warning and never tried again. Writes go to a
temporary name, are fsynced and renamed. This vault's entries are kept under ``max_bytes``:
the least recently used go first, and an entry whose tokens a newer entry extends goes
when that one is written.

Threads: ``open``, ``take`` and ``aclose`` run on the event loop, and ``keep`` is called
from it; the KV arrays are only touched on the engine's compute thread (a write is queued
there before the sequence is handed on, so no later step can change it first); the fsync
and rename run in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiofiles.os
import anyio
import xxhash

from smoe.engine import conversation_file
from smoe.errors import SmoeError
from smoe.util.files import fsync_path, sweep_stale, temp_path
from smoe.util.tokens import common_prefix

if TYPE_CHECKING:
    from smoe.compute.sequence import Sequence_
    from smoe.engine.core import Engine
    from smoe.engine.handles import SequenceHandle

__all__ = ["PrefixStore", "StoreCounts", "FORMAT", "MIN_TOKENS"]

log = logging.getLogger("smoe.serve")

FORMAT = "smoe-prefix-1"
SUFFIX = ".safetensors"
MIN_TOKENS = 256  # a prefix shorter than this is not worth a file (its prefill is short)
HEADER_MAX = 64 * 1024**2  # a header larger than this is not one of ours


@dataclass
class Entry:
    """One of this vault's entries: its file, the ids its cache holds, its size."""

    path: Path
    tokens: list[int]
    nbytes: int
    used: float  # when it was written or last loaded (its file's mtime)


@dataclass
class StoreCounts:
    """What /v1/smoe/stats reports of the store."""

    hits: int = 0  # prompts that started from an entry loaded from disk
    reused_tokens: int = 0  # prompt tokens those entries held
    writes: int = 0
    write_failures: int = 0
    ignored: int = 0  # entries found damaged or foreign (at open) or damaged (at load)


class PrefixStore:
    """Long prompts' KV caches in ``directory``, at most ``max_bytes`` of this vault's.

    ``take(prompt)`` loads the entry sharing the longest prefix with ``prompt`` when that
    prefix is at least ``min_tokens`` long; ``keep(seq)`` writes a finished request's
    cache when it holds at least ``min_tokens`` ids that no entry holds already."""

    def __init__(
        self, engine: Engine, directory: Path, max_bytes: int, min_tokens: int = MIN_TOKENS
    ) -> None:
        self.engine = engine
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.min_tokens = max(1, min_tokens)
        self.entries: list[Entry] = []
        self.counts = StoreCounts()
        self._fingerprint = ""
        self._kv_bits = json.dumps(engine.options.kv_bits)
        self._writes: set[asyncio.Task[None]] = set()
        self._pending: list[list[int]] = []  # the ids of the writes under way

    # ------------------------------------------------------------------ reading
    async def open(self) -> None:
        """Create the directory if needed and index this vault's entries (headers only).
        Raises SmoeError if the directory cannot be made or listed."""
        from smoe.engine.conversation import vault_fingerprint

        try:
            await anyio.Path(self.directory).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SmoeError(
                f"--prefix-cache-dir {self.directory}: cannot create it ({e.strerror}); "
                "pick a writable directory"
            ) from None
        self._fingerprint = vault_fingerprint(self.engine)
        try:
            entries, ignored = await anyio.to_thread.run_sync(self._scan)
        except OSError as e:
            raise SmoeError(
                f"--prefix-cache-dir {self.directory}: cannot list it ({e.strerror})"
            ) from None
        self.entries = sorted(entries, key=lambda e: e.used, reverse=True)
        if ignored:
            self.counts.ignored += ignored
            log.warning(
                "prefix cache %s: %d entries ignored (another model's or KV precision's, or "
                "damaged); %d of this model's kept",
                self.directory,
                ignored,
                len(self.entries),
            )

    def _scan(self) -> tuple[list[Entry], int]:
        sweep_stale(self.directory, suffix=SUFFIX)  # what writers killed mid-write left
        vocab = self.engine.vault.manifest.shape.vocab_size
        found, ignored = [], 0
        for name in os.listdir(self.directory):
            path = self.directory / name
            if not name.endswith(SUFFIX) or name.startswith("."):
                continue
            meta = read_header(path)
            tokens = self._own_tokens(meta, vocab) if meta is not None else None
            if tokens is None:
                ignored += 1
                continue
            st = path.stat()
            found.append(Entry(path, tokens, st.st_size, st.st_mtime))
        return found, ignored

    def _own_tokens(self, meta: dict[str, str], vocab: int) -> list[int] | None:
        """The ids an entry's header says it holds, if it is this engine's and whole."""
        if (
            meta.get("format") != FORMAT
            or meta.get("vault") != self._fingerprint
            or meta.get("kv_bits") != self._kv_bits
        ):
            return None
        try:
            tokens = json.loads(meta["tokens"])
            cached = int(meta["cached"])
        except (KeyError, ValueError, TypeError):
            return None
        if not isinstance(tokens, list) or cached != len(tokens) or not tokens:
            return None
        if not all(type(t) is int and 0 <= t < vocab for t in tokens):
            return None
        return tokens

    def longest(self, prompt: list[int]) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with ``prompt``, and that length; the last
        prompt token never counts (it runs to give the first token)."""
        best, best_n = None, 0
        for entry in self.entries:
            n = common_prefix(entry.tokens, prompt[:-1])
            if n > best_n:
                best, best_n = entry, n
        return best, best_n

    async def take(self, prompt: list[int], have: int = 0) -> tuple[SequenceHandle | None, int]:
        """A sequence loaded from the entry sharing the longest prefix with ``prompt``, and
        that prefix's length, where it is at least ``min_tokens`` and longer than ``have``
        (what the caller holds in memory); else (None, 0). A damaged entry is dropped with
        a warning and (None, 0) returned. Cancelling it leaves the store as it was."""
        entry, n = self.longest(prompt)
        if entry is None or n < self.min_tokens or n <= have:
            return None, 0
        engine = self.engine
        try:
            async with engine.exclusive():  # (mlx reads the file on the compute thread)
                seq = await engine.debug.parts().compute.run(self._load, entry)
        except SmoeError as e:
            self._forget(entry)
            self.counts.ignored += 1
            log.warning("prefix cache: %s; ignored", e)
            return None, 0
        entry.used = await anyio.to_thread.run_sync(_touch, entry.path)
        self.entries.remove(entry)
        self.entries.insert(0, entry)
        self.counts.hits += 1
        self.counts.reused_tokens += n
        return seq, n

    def _load(self, entry: Entry) -> Sequence_:  # compute thread
        from mlx_lm.models.cache import load_prompt_cache

        from smoe.compute.sequence import Sequence_

        path = entry.path
        try:
            cache, meta = load_prompt_cache(str(path), return_metadata=True)  # type: ignore[no-untyped-call]
        except Exception as e:  # a truncated or rewritten file
            raise SmoeError(f"{path.name} is not readable ({e})") from None
        if meta.get("digest") != conversation_file.conversation_digest(
            meta, conversation_file.cache_arrays(cache)
        ):
            raise SmoeError(f"{path.name} does not match its checksum (damaged)")
        if meta.get("tokens") != json.dumps(entry.tokens) or meta.get("vault") != (
            self._fingerprint
        ):
            raise SmoeError(f"{path.name} changed since the directory was read")
        if len(cache) != len(self.engine.debug.parts().runner.new_cache()):
            raise SmoeError(f"{path.name} holds {len(cache)} KV layers, not this model's")
        offsets = {int(getattr(c, "offset", len(entry.tokens))) for c in cache if not c.empty()}
        if offsets != {len(entry.tokens)}:
            raise SmoeError(f"{path.name} holds {sorted(offsets)} positions, not its tokens'")
        return Sequence_(cache=cache, tokens=list(entry.tokens), cached=len(entry.tokens))

    # ------------------------------------------------------------------ writing
    def keep(self, seq: SequenceHandle) -> None:
        """Write ``seq``'s cache as an entry, in the background, if it holds at least
        ``min_tokens`` ids beyond what an entry holds. Call it before the sequence is
        handed to anyone else: the arrays are read by a job queued now on the compute
        thread. Never raises; a failed write is logged and counted."""
        tokens = seq.tokens[: seq.cached]
        if len(tokens) < self.min_tokens or not self._fingerprint:
            return
        _, covered = self.longest([*tokens, 0])
        covered = max([covered, *(common_prefix(p, tokens) for p in self._pending)])
        if len(tokens) - covered < self.min_tokens:
            return
        path = self.directory / f"{self._key(tokens)}{SUFFIX}"
        tmp = temp_path(path, keep_suffix=True)
        job = self.engine.debug.parts().compute.submit(self._write, seq, tmp)
        task = asyncio.get_running_loop().create_task(self._finish(job, tmp, path))
        self._writes.add(task)
        self._pending.append(tokens)  # (a write under way covers its ids too)

        def done(t: asyncio.Task[None]) -> None:
            self._writes.discard(t)
            self._pending.remove(tokens)

        task.add_done_callback(done)

    def _key(self, tokens: list[int]) -> str:
        h = xxhash.xxh3_128(f"{self._fingerprint}\0{self._kv_bits}\0".encode())
        h.update(json.dumps(tokens).encode())
        return h.hexdigest()

    def _write(self, seq: Sequence_, tmp: Path) -> list[int]:  # compute thread
        """Write ``seq``'s cache to ``tmp`` (not yet fsynced); the ids it holds."""
        from mlx_lm.models.cache import save_prompt_cache

        if seq.prompt is not None:  # a prefill cut off midway: nothing whole to keep
            return []
        self.engine.debug.parts().runner.settle(seq)
        tokens = list(seq.tokens[: seq.cached])
        meta = {
            "format": FORMAT,
            "vault": self._fingerprint,
            "model_type": self.engine.vault.manifest.shape.model_type,
            "kv_bits": self._kv_bits,
            "tokens": json.dumps(tokens),
            "cached": str(len(tokens)),
        }
        arrays = conversation_file.cache_arrays(seq.cache)
        meta["digest"] = conversation_file.conversation_digest(meta, arrays)
        try:
            save_prompt_cache(str(tmp), seq.cache, meta)
        except RuntimeError as e:  # how mlx reports a file it cannot write
            raise OSError(str(e)) from None
        return tokens

    async def _finish(self, job: Any, tmp: Path, path: Path) -> None:
        """Wait for the compute thread's part, then make the entry durable and index it."""
        try:
            tokens = await asyncio.wrap_future(job)
            if not tokens:
                return
            st = await anyio.to_thread.run_sync(_publish, tmp, path)
        except Exception as e:
            self.counts.write_failures += 1
            log.warning("prefix cache: cannot write %s (%s); the prompt is not kept", path, e)
            with contextlib.suppress(OSError):
                await aiofiles.os.remove(tmp)
            return
        self.entries = [e for e in self.entries if e.path != path]
        self.entries.insert(0, Entry(path, tokens, st.st_size, st.st_mtime))
        self.counts.writes += 1
        # An entry the new one extends is never the longest match again; then the least
        # recently used go while over the bound (the new one too, if alone it is over).
        stale = [e for e in self.entries[1:] if tokens[: len(e.tokens)] == e.tokens]
        for entry in stale:
            await self._drop(entry)
        while self.entries and self.nbytes() > self.max_bytes:
            await self._drop(self.entries[-1])

    async def _drop(self, entry: Entry) -> None:
        self._forget(entry)
        with contextlib.suppress(OSError):
            await aiofiles.os.remove(entry.path)

    def _forget(self, entry: Entry) -> None:
        if entry in self.entries:
            self.entries.remove(entry)

    def nbytes(self) -> int:
        """Bytes of this vault's entries."""
        return sum(e.nbytes for e in self.entries)

    async def aclose(self) -> None:
        """Wait for the writes under way (shielded: an entry is written whole or not)."""
        with anyio.CancelScope(shield=True):
            while self._writes:
                await asyncio.gather(*list(self._writes), return_exceptions=True)

    def stats(self) -> dict[str, Any]:
        c = self.counts
        return {
            "directory": str(self.directory),
            "entries": len(self.entries),
            "bytes": self.nbytes(),
            "max_bytes": self.max_bytes,
            "hits": c.hits,
            "reused_tokens": c.reused_tokens,
            "writes": c.writes,
            "write_failures": c.write_failures,
            "ignored": c.ignored,
        }


def read_header(path: Path) -> dict[str, str] | None:
    """The metadata fields mlx-lm's ``save_prompt_cache`` wrote (its ``metadata`` argument),
    from the safetensors header alone; None if the file is not such a file."""
    from safetensors import safe_open

    try:
        if path.stat().st_size < 8:
            return None
        with open(path, "rb") as f:
            if int.from_bytes(f.read(8), "little") > HEADER_MAX:
                return None
        with safe_open(str(path), "np") as f:
            raw = f.metadata() or {}
    except Exception:  # not a safetensors file, or a damaged one
        return None
    return {k[2:]: v for k, v in raw.items() if k.startswith("0.")}


def _publish(tmp: Path, path: Path) -> os.stat_result:
    """fsync ``tmp``, rename it to ``path``, fsync the directory; ``path``'s stat."""
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(path.parent)
    return path.stat()


def _touch(path: Path) -> float:
    with contextlib.suppress(OSError):
        os.utime(path)
        return path.stat().st_mtime
    return 0.0
