"""A saved conversation's file: what identifies the weights it was made with, the digest
that covers its fields and its KV bytes, and the check of every field before anything is
restored. The file is untrusted (a user may load any file, a disk may rot it): each bad
field is one SmoeError naming the file and the field, and nothing is restored.

Layout: a safetensors file (mlx-lm's ``save_prompt_cache``: the KV cache's arrays) whose
metadata holds ``format``, ``vault`` (the weights' fingerprint), ``model_type``, ``system``,
``messages``, ``kv_bits``, ``tokens``, ``cached``, ``reply_end`` (JSON strings) and
``digest``: xxh3-128 of those fields and of every KV array's bytes, in order.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from smoe.errors import SmoeError

FORMAT = "smoe-conversation-2"  # with ``digest``
FORMAT_1 = "smoe-conversation-1"  # before the digest: its fields are checked, not its bytes
FIELDS = ("format", "vault", "model_type", "system", "messages", "kv_bits", "tokens", "cached")


def vault_fingerprint_of(checksums: Any, backbone: Path, dtype: Any) -> str:
    """Identifies the weights a KV cache was computed with: the records' checksums, the
    backbone file's first 4 KiB (its header: names, shapes, dtypes) and the compute dtype.
    Reads 4 KiB of the backbone, not all of it."""
    h = hashlib.sha256(json.dumps(checksums).encode())
    with open(backbone, "rb") as f:
        h.update(f.read(4096))
    h.update(str(dtype).encode())
    return h.hexdigest()[:32]


def conversation_digest(meta: dict[str, str], arrays: list[Any]) -> str:
    """xxh3-128 over the metadata fields (not ``digest``) and the arrays' bytes."""
    import mlx.core as mx
    import numpy as np

    h = xxhash.xxh3_128()
    for key in sorted(k for k in meta if k != "digest"):
        h.update(f"{key}={meta[key]}\0".encode())
    for a in arrays:
        if not isinstance(a, mx.array):  # (a number some caches keep in their state)
            h.update(repr(a).encode())
            continue
        h.update(f"{a.dtype}{tuple(a.shape)}".encode())
        h.update(np.asarray(a.view(mx.uint8)).tobytes() if a.size else b"")
    return h.hexdigest()


def cache_arrays(cache: list[Any]) -> list[Any]:
    """The KV cache's arrays, layer by layer, in a fixed order."""
    from mlx.utils import tree_flatten

    flat = tree_flatten([c.state for c in cache if not c.empty()])
    assert isinstance(flat, list)
    return [a for _, a in flat]


@dataclass(frozen=True)
class Saved:
    """A conversation file's fields, checked."""

    system: str | None
    messages: list[dict[str, str]]
    tokens: list[int]
    cached: int
    reply_end: int | None


def _json(meta: dict[str, str], key: str, path: Path) -> Any:
    try:
        return json.loads(meta[key])
    except KeyError:
        raise SmoeError(f"{path} has no '{key}' field: not a whole conversation file") from None
    except (TypeError, ValueError):
        raise SmoeError(f"{path}: its '{key}' field is not JSON; the file is damaged") from None


def check(meta: dict[str, str], cache: list[Any], path: Path, vocab: int) -> Saved:
    """The file's fields, each checked (SmoeError naming the field otherwise), after its
    format, weights and kv_bits were (``Conversation.load``). ``cache``: its KV layers."""
    needed = FIELDS if meta.get("format") == FORMAT_1 else (*FIELDS, "digest")
    missing = [k for k in needed if k not in meta]
    if missing:
        raise SmoeError(f"{path} lacks {', '.join(missing)}: not a whole conversation file")
    if "digest" in needed and meta["digest"] != conversation_digest(meta, cache_arrays(cache)):
        raise SmoeError(
            f"{path} does not match its checksum: its history or KV cache changed since it "
            "was saved (a damaged disk or an edit); it cannot be trusted"
        )
    system = _json(meta, "system", path)
    if system is not None and not isinstance(system, str):
        raise SmoeError(f"{path}: 'system' must be text or null")
    messages = _json(meta, "messages", path)
    if not isinstance(messages, list) or not all(
        isinstance(m, dict)
        and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in m.items())
        for m in messages
    ):
        raise SmoeError(f"{path}: 'messages' must be a list of {{role, content}} texts")
    tokens = _json(meta, "tokens", path)
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab for t in tokens):
        raise SmoeError(f"{path}: 'tokens' must be a list of token ids below {vocab}")
    try:
        cached = int(meta["cached"])
    except ValueError:
        raise SmoeError(f"{path}: 'cached' must be a whole number") from None
    if not 0 <= cached <= len(tokens):
        raise SmoeError(f"{path}: 'cached' is {cached}, not within 0..{len(tokens)} tokens")
    offsets = {int(getattr(c, "offset", cached)) for c in cache if not c.empty()}
    if offsets and offsets != {cached}:
        raise SmoeError(
            f"{path}: its KV cache holds {sorted(offsets)} tokens, not the {cached} it says"
        )
    end = _json(meta, "reply_end", path) if "reply_end" in meta else None
    if end is not None and (type(end) is not int or not 0 < end <= len(tokens)):
        raise SmoeError(f"{path}: 'reply_end' must be null or within 1..{len(tokens)}")
    return Saved(system, messages, tokens, cached, end)
