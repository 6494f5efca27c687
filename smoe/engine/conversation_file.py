"""A saved conversation's file: what identifies the weights it was made with, the digest
that covers its fields and its KV bytes, and the check of every field before anything is
restored. The file is untrusted (a user may load any file, a disk may rot it): each bad
field is one SmoeError naming the file and the field, and nothing is restored.

Layout: a safetensors file (mlx-lm's ``save_prompt_cache``: the KV cache's arrays) whose
metadata holds ``format``, ``vault`` (the weights' fingerprint), ``model_type``, ``system``,
``messages``, ``kv_bits``, ``tokens``, ``cached``, ``reply_end`` (JSON strings) and
``digest``: xxh3-128 of those fields and of every KV array's bytes, in order.

The header is checked before any array is read (``read_header``, ``check_arrays``), and
each JSON field's nesting and size before it is parsed (``check``): what a file declares
cannot make loading it take more memory than a conversation of the engine's context.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from smoe.errors import SmoeError
from smoe.models.dtypes import SAFETENSORS_FLOATS
from smoe.plan.budget import Attention

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


# How deep each field's JSON nests (a message is an object in a list); deeper is refused
# before parsing, which recurses once per level.
DEPTH = {"messages": 2, "tokens": 1}


def parse_field(meta: dict[str, str], key: str, path: Path) -> Any:
    """The JSON of field ``key``, its nesting checked first (SmoeError naming it)."""
    try:
        raw = meta[key]
    except KeyError:
        raise SmoeError(f"{path} has no '{key}' field: not a whole conversation file") from None
    most = DEPTH.get(key, 0)
    if not isinstance(raw, str) or json_depth(raw.encode("utf-8", "replace")) > most:
        raise SmoeError(
            f"{path}: its '{key}' field nests lists deeper than a conversation's (at most "
            f"{most}); the file is damaged"
        )
    try:
        return json.loads(raw)
    except (TypeError, ValueError, RecursionError):
        raise SmoeError(f"{path}: its '{key}' field is not JSON; the file is damaged") from None


def check(meta: dict[str, str], cache: list[Any], path: Path, vocab: int, context: int) -> Saved:
    """The file's fields, each checked (SmoeError naming the field otherwise), after its
    header, format, weights and kv_bits were (``Conversation.load``). ``cache``: its KV
    layers; ``context``: the engine's, which the token stream must fit."""
    needed = FIELDS if meta.get("format") == FORMAT_1 else (*FIELDS, "digest")
    missing = [k for k in needed if k not in meta]
    if missing:
        raise SmoeError(f"{path} lacks {', '.join(missing)}: not a whole conversation file")
    if "digest" in needed and meta["digest"] != conversation_digest(meta, cache_arrays(cache)):
        raise SmoeError(
            f"{path} does not match its checksum: its history or KV cache changed since it "
            "was saved (a damaged disk or an edit); it cannot be trusted"
        )
    # Counted before parsing: a list's items cost more memory parsed than as text.
    if _skeleton(meta["messages"].encode("utf-8", "replace")).count(b"{") > context + 1:
        raise SmoeError(
            f"{path}: 'messages' holds more messages than a context of {context} tokens can"
        )
    if meta["tokens"].count(",") >= context:
        raise SmoeError(f"{path}: 'tokens' holds more than this engine's {context} tokens")
    system = parse_field(meta, "system", path)
    if system is not None and not isinstance(system, str):
        raise SmoeError(f"{path}: 'system' must be text or null")
    messages = parse_field(meta, "messages", path)
    if not isinstance(messages, list) or not all(
        isinstance(m, dict)
        and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in m.items())
        for m in messages
    ):
        raise SmoeError(f"{path}: 'messages' must be a list of {{role, content}} texts")
    tokens = parse_field(meta, "tokens", path)
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab for t in tokens):
        raise SmoeError(f"{path}: 'tokens' must be a list of token ids below {vocab}")
    if len(tokens) > context:
        raise SmoeError(f"{path}: 'tokens' holds more than this engine's {context} tokens")
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
    end = parse_field(meta, "reply_end", path) if "reply_end" in meta else None
    if end is not None and (type(end) is not int or not 0 < end <= len(tokens)):
        raise SmoeError(f"{path}: 'reply_end' must be null or within 1..{len(tokens)}")
    return Saved(system, messages, tokens, cached, end)


# ------------------------------------------------------------------ the header, first
# A crafted header can declare arrays of any size over a sparse file (a few KB on disk,
# gigabytes read back): reading them, or the digest over them, would take the memory of
# what the header declares. So the header is read alone and checked against the model
# (layers, cache kinds, heads, widths, dtype, at most the context's tokens) and against
# the file's size before mlx reads any array (issue 49).

HEADER_BASE = 1 << 20  # the arrays' entries and a history's fixed part, generously
HEADER_PER_TOKEN = 1024  # the history text one token of context may carry, JSON-escaped
HEADER_DEPTH = 3  # {"name": {"shape": [...]}}
KV_STEP = 256  # mlx-lm's caches grow by 256 tokens: one may hold up to that many spare
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "I64": 8}
_ARRAY = re.compile(r"(0|[1-9][0-9]{0,5})\.(0|[1-9][0-9]?)(?:\.(0|[1-9]))?")
_INDEX = re.compile(r"0|[1-9][0-9]{0,6}")


@dataclass(frozen=True)
class Layout:
    """What a conversation file's arrays must be for the engine that loads it."""

    classes: tuple[frozenset[str], ...]  # per KV layer, the cache kinds it may hold
    dtype: str  # the compute dtype as safetensors names it (F32, F16, BF16)
    widths: tuple[tuple[int, int], tuple[int, int]]  # (heads, width) of keys, of values
    context: int  # the engine's max_context, in tokens
    kv_bits: int | None
    kv_group: int

    @property
    def header_limit(self) -> int:
        return HEADER_BASE + HEADER_PER_TOKEN * self.context


def kv_widths(config: dict[str, Any]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(heads, width) of the keys and of the values one layer of mlx-lm's cache holds per
    token: kv_heads x head_dim each; DeepSeek-V2's MLA keys of nope+rope and values of
    v_head_dim per head; DeepSeek-V3's latent and one rope key (as smoe.plan.budget's
    kv_elements counts them)."""
    attn = Attention.of(config)
    if config.get("kv_lora_rank"):
        rope = int(config.get("qk_rope_head_dim") or 0)
        if config.get("model_type") in ("deepseek_v3", "kimi_k2"):
            return (1, int(config["kv_lora_rank"])), (1, rope)
        nope, v = int(config.get("qk_nope_head_dim") or 0), int(config.get("v_head_dim") or 0)
        return (attn.heads, nope + rope), (attn.heads, v)
    return (attn.kv_heads, attn.head_dim), (attn.kv_heads, attn.head_dim)


def layout_of(
    cache: list[Any], dtype: Any, config: dict[str, Any], context: int, bits: int | None, group: int
) -> Layout:
    """The Layout of an engine whose fresh cache is ``cache``: a full-precision layer
    (KVCache) is quantized once it holds tokens when the engine runs with --kv-bits."""
    kinds = []
    for c in cache:
        name = type(c).__name__
        quantized = bits is not None and name == "KVCache"
        kinds.append(frozenset({name, "QuantizedKVCache"} if quantized else {name}))
    floats = {v: k for k, v in SAFETENSORS_FLOATS.items()}
    return Layout(
        tuple(kinds), floats[str(dtype).rsplit(".", 1)[-1]], kv_widths(config), context, bits, group
    )


@dataclass(frozen=True)
class Header:
    """A conversation file's header, its structure checked (``read_header``)."""

    meta: dict[str, str]  # our fields, without mlx-lm's "0." prefix
    classes: dict[int, str]  # layer -> cache kind
    scalars: dict[str, str]  # array name -> "scalar" or "none" (a number or None kept)
    arrays: dict[str, tuple[str, list[int]]]  # array name -> (dtype, shape)


def _unreadable(path: Path, why: str) -> SmoeError:
    return SmoeError(f"{path} is not a readable conversation file: {why}")


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):  # parsers disagree on which one counts: refuse them all
        raise ValueError("a name appears twice")
    return out


def read_header(path: Path, limit: int) -> Header:
    """The header of the conversation file at ``path``, read alone (no array is): its
    length at most ``limit`` bytes and within the file, nesting, names, every array's
    dtype, shape and bytes within the file. SmoeError naming the file otherwise."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            first = f.read(8)
            length = int.from_bytes(first, "little") if len(first) == 8 else 0
            if not 0 < length <= size - 8:
                raise _unreadable(path, "its header runs past its end (a truncated file)")
            if length > limit:
                raise _unreadable(
                    path,
                    f"its header is {length} bytes, over the {limit} a "
                    "conversation of this engine's context can have",
                )
            raw = f.read(length)
    except OSError as e:
        raise SmoeError(f"cannot read {path}: {e.strerror or e}") from None
    if json_depth(raw) > HEADER_DEPTH:
        raise _unreadable(path, f"its header nests deeper than {HEADER_DEPTH} levels")
    try:
        header = json.loads(raw, object_pairs_hook=_unique)
    except (ValueError, RecursionError) as e:
        raise _unreadable(path, f"its header is not JSON ({e})") from None
    meta = header.pop("__metadata__", None) if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _unreadable(path, "its header has no metadata of texts")
    out = Header({}, {}, {}, {})
    pairs: dict[str, dict[str, str]] = {}
    for key, value in meta.items():
        group, _, rest = key.partition(".")
        if group == "0" and rest.isidentifier():
            out.meta[rest] = value
        elif group == "1" and _INDEX.fullmatch(rest):
            out.classes[int(rest)] = value
        elif key == "2.0" and not value:
            pass
        elif group == "2" and rest[-2:] in (".0", ".1") and _INDEX.fullmatch(rest[:-2]):
            pairs.setdefault(rest[:-2], {})[rest[-1]] = value
        else:
            raise _unreadable(path, f"its metadata has an unknown entry {key[:40]!r}")
    for pair in pairs.values():
        if set(pair) != {"0", "1"} or pair["1"] not in ("scalar", "none"):
            raise _unreadable(path, "its metadata lists a kept value wrongly")
        out.scalars[pair["0"]] = pair["1"]
    room, used = size - 8 - length, 0
    for name, entry in header.items():
        dtype, shape, span = _entry(entry)
        if not _ARRAY.fullmatch(name) or dtype not in _ITEMSIZE or shape is None or not span:
            raise _unreadable(path, f"its array entry {name[:40]!r} is malformed")
        begin, end = span
        if not 0 <= begin <= end <= room or end - begin != math.prod(shape) * _ITEMSIZE[dtype]:
            raise _unreadable(
                path,
                f"its array {name!r} runs past the file's end or "
                "disagrees with its shape (a truncated or edited file)",
            )
        used += end - begin
        out.arrays[name] = (dtype, shape)
    if used > room or not set(out.scalars) <= set(out.arrays):
        raise _unreadable(path, "its arrays overlap or are missing (an edited file)")
    return out


def _entry(entry: Any) -> tuple[str, list[int] | None, list[int] | None]:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        return "", None, None

    def ints(v: Any, most: int) -> list[int] | None:
        ok = isinstance(v, list) and len(v) <= most and all(type(x) is int and x >= 0 for x in v)
        return v if ok else None

    span = ints(entry["data_offsets"], 2)
    return str(entry["dtype"]), ints(entry["shape"], 4), span if span and len(span) == 2 else None


def check_arrays(header: Header, layout: Layout, path: Path) -> None:
    """Every KV array ``header`` declares is one this engine's cache would hold: the
    model's layers and cache kinds, [1, heads, tokens, width] in its dtype (quantized:
    packed words, scales and biases) with at most the context's tokens (plus the
    cache's growth step), each layer's arrays of one length; a kept value a number."""
    layers = len(layout.classes)
    if set(header.classes) != set(range(layers)):
        raise SmoeError(f"{path} holds {len(header.classes)} KV layers, this model has {layers}")
    for i, kind in header.classes.items():
        if kind not in layout.classes[i]:
            raise SmoeError(
                f"{path}: its layer {i} is a {kind[:40]!r} cache, not the "
                f"{' or '.join(sorted(layout.classes[i]))} this model keeps; it is damaged"
            )
    lengths: dict[int, set[int]] = {}
    most = layout.context + KV_STEP
    for name, (dtype, shape) in header.arrays.items():
        parsed = _ARRAY.fullmatch(name)
        assert parsed is not None  # (read_header matched it)
        layer, part, piece = parsed.groups()
        if int(layer) >= layers:
            raise SmoeError(f"{path}: its array {name!r} is past the model's {layers} layers")
        kept = header.scalars.get(name)
        if kept is not None:
            number = shape == [] and dtype in ("I32", "I64")
            if not (shape == [0] if kept == "none" else number):
                raise _unreadable(path, f"its kept value {name!r} is not a whole number")
            continue
        quantized = header.classes[int(layer)] == "QuantizedKVCache"
        if int(part) > 1 or (piece is not None) != quantized:
            raise _unreadable(path, f"its array {name!r} is not one of a KV cache's")
        heads, width = layout.widths[int(part)]
        want, last = layout.dtype, width
        if quantized and layout.kv_bits:  # packed words, then a scale and a bias a group
            packed = piece == "0"
            want = "U32" if packed else layout.dtype
            last = width * layout.kv_bits // 32 if packed else width // layout.kv_group
        if len(shape) != 4 or shape[:2] != [1, heads] or shape[3] != last or dtype != want:
            raise SmoeError(
                f"{path}: its KV array {name!r} is {dtype} {shape}, not this model's "
                f"{want} [1, {heads}, tokens, {last}]; the file is damaged or another model's"
            )
        if shape[2] > most:
            raise SmoeError(
                f"{path}: its KV array {name!r} holds {shape[2]} tokens, over this "
                f"engine's context of {layout.context}; it cannot be loaded here"
            )
        lengths.setdefault(int(layer), set()).add(shape[2])
    if any(len(n) > 1 for n in lengths.values()):
        raise _unreadable(path, "a layer's keys and values differ in length")


def check_read(header: Header, cache: list[Any], meta: dict[str, str], path: Path) -> None:
    """What mlx read (lazily: no array yet) is what ``header`` declared, checked: not a
    file put in its place meanwhile."""
    import mlx.core as mx

    read = sorted(list(a.shape) for a in cache_arrays(cache) if isinstance(a, mx.array))
    declared = sorted(
        shape for name, (_, shape) in header.arrays.items() if name not in header.scalars
    )
    if meta != header.meta or read != declared:
        raise SmoeError(f"{path} changed while it was being read; load it again")


def check_kept(cache: list[Any], fresh: list[Any], layout: Layout, path: Path) -> None:
    """The numbers each loaded layer keeps beside its arrays (read from the file) are this
    engine's: a sliding window's size, a quantized cache's group and bits, a position
    within the arrays it holds."""
    for i, (c, f) in enumerate(zip(cache, fresh, strict=True)):
        want = {k: getattr(f, k) for k in ("keep", "max_size") if hasattr(f, k)}
        if type(c).__name__ == "QuantizedKVCache":
            want.update(group_size=layout.kv_group, bits=layout.kv_bits)
        got = {k: getattr(c, k, None) for k in want}
        offset, index = getattr(c, "offset", 0), getattr(c, "_idx", 0)
        held = [a.shape[2] for a in cache_arrays([c]) if getattr(a, "ndim", 0) == 4]
        window = want.get("max_size", offset)
        if (
            got != want
            or type(offset) is not int
            or type(index) is not int
            or not 0 <= index <= window
            or offset < 0
            or (held and min(offset, window) > held[0])
        ):
            raise SmoeError(
                f"{path}: its layer {i} keeps settings or a position that this model's cache "
                "cannot have; the file is damaged"
            )


# ------------------------------------------------------------------ JSON fields, bounded
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)  # an unterminated one runs out
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _skeleton(raw: bytes) -> bytes:
    """The brackets of JSON text ``raw`` (maybe invalid) outside its strings. Linear time:
    possessive quantifiers never backtrack; a string left open runs to the end."""
    return _STRING.sub(b"", raw).translate(None, delete=_NOT_BRACKETS)


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in ``raw``, found without parsing, so
    without recursion (json.loads recurses once per level: a deep enough text is a
    RecursionError, which ended `smoe chat`)."""
    import numpy as np

    brackets = _skeleton(raw)
    if not brackets:
        return 0
    a = np.frombuffer(brackets, np.uint8)
    return int(np.cumsum(np.where((a == ord("[")) | (a == ord("{")), 1, -1)).max())
