"""Deterministic random tensor values, streamed into Hugging Face-style safetensors shards.

Every value is drawn from a 65,536-entry table of normal quantiles rounded to bfloat16, indexed
by random 16-bit numbers from a PCG64 stream seeded by (seed, tensor name, chunk index). So:
- a tensor's bytes depend only on the seed, its name and its shape, never on writing order or
  on the number of layers;
- the float32 and float16 checkpoints hold the very same values as the bfloat16 one (float16 up
  to subnormal rounding of values below 6e-5), so the three describe one model;
- generation is a table lookup (~1 GB/s per core), cheaper than the disk writes.
The LM head may draw some rows (tokens) from a narrower table: see init_for's quiet_tokens.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from statistics import NormalDist
from typing import BinaryIO

import numpy as np

from smoe.synth.layout import TensorSpec

CHUNK = 1 << 20  # elements per independently seeded chunk; part of the determinism contract
MAX_SHARD_BYTES = 2_000_000_000  # like save_pretrained(max_shard_size="2GB")

# Scale of the tensors that decide things. Everything else is LeCun-normal (std 1/sqrt(fan_in)),
# which keeps hidden states at rms ~1 through the layers in bf16 and f32. Router logits get a std
# of ROUTER_GAIN: the median rank-k/k+1 gap is ~0.8 logit at top-2 of 8, and the k-th expert still
# carries ~20% of the weight, so every selected expert shows in the output. LM-head logits get a
# std of HEAD_GAIN: the
# top-1 margin is > 1 logit at ~80% of steps. Scale cannot change margins *relative* to the
# logits (random logits leave ~1% of steps below 1e-3 relative): float32 frameworks agree to
# ~1e-6, far below that; bfloat16 vs float32 differ by ~1% and will flip a few % of steps.
ROUTER_GAIN = 3.0
SIGMOID_ROUTER_GAIN = 2.0  # DeepSeek-V3 scores with a sigmoid, which saturates beyond |x| ~ 5
HEAD_GAIN = 16.0
EMBED_STD = 1.0


@dataclass(frozen=True)
class Init:
    mean: float
    std: float
    # Rows (dim 0) drawn with std * QUIET_GAIN: LM-head rows of tokens that should rarely win.
    quiet_rows: np.ndarray | None = None


QUIET_GAIN = 0.25


def init_for(
    spec: TensorSpec,
    *,
    hidden: int,
    experts: int,
    sigmoid_router: bool,
    tied: bool,
    quiet_tokens: np.ndarray | None = None,
) -> Init:
    """Mean and std for one tensor, chosen from its name and shape.

    tied: the embedding doubles as the LM head. quiet_tokens: bool mask over the vocabulary of
    tokens the untied LM head should rarely predict (stray bytes, control characters).
    """
    name, shape = spec.name, spec.shape
    if name.endswith("norm.weight"):
        return Init(1.0, 0.02)  # RMSNorm / LayerNorm gains: identity plus a little noise
    if name.endswith("bias") or name.endswith("sinks"):
        return Init(0.0, 0.02)  # biases, DeepSeek's e_score_correction_bias, gpt-oss sinks
    if name.endswith("lm_head.weight"):
        return Init(0.0, HEAD_GAIN / math.sqrt(hidden), quiet_tokens)
    if name.endswith("embed_tokens.weight"):
        return Init(0.0, HEAD_GAIN / math.sqrt(hidden) if tied else EMBED_STD)
    if re.search(r"\.(gate|router)\.weight$", name) and shape[0] == experts:
        gain = SIGMOID_ROUTER_GAIN if sigmoid_router else ROUTER_GAIN
        return Init(0.0, gain / math.sqrt(hidden))
    if len(shape) == 3:
        return Init(0.0, 1.0 / math.sqrt(shape[1]))  # gpt-oss fused experts: [E, in, out]
    if len(shape) == 2:
        return Init(0.0, 1.0 / math.sqrt(shape[1]))  # nn.Linear: [out, in]
    return Init(0.0, 0.02)


@cache
def _quantiles() -> np.ndarray:
    nd = NormalDist()
    return np.array([nd.inv_cdf((i + 0.5) / 65536) for i in range(65536)], dtype=np.float64)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype("<u2")


@cache
def value_table(mean: float, std: float, st_dtype: str) -> np.ndarray:
    """65,536 bfloat16-representable values in the on-disk dtype, indexed by a random uint16."""
    bits = bf16_bits((mean + std * _quantiles()).astype(np.float32))
    if st_dtype == "BF16":
        return bits
    f32 = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return f32.astype("<f4" if st_dtype == "F32" else "<f2")


@dataclass(frozen=True)
class Sampler:
    """What a worker needs to produce any chunk of one tensor."""

    table: np.ndarray
    quiet_table: np.ndarray | None = None
    quiet_rows: np.ndarray | None = None
    row_len: int = 1


def sampler(spec: TensorSpec, init: Init) -> Sampler:
    table = value_table(init.mean, init.std, spec.dtype)
    if init.quiet_rows is None:
        return Sampler(table)
    quiet = value_table(init.mean, init.std * QUIET_GAIN, spec.dtype)
    return Sampler(table, quiet, init.quiet_rows, spec.numel // spec.shape[0])


def _name_words(name: str) -> list[int]:
    digest = hashlib.blake2b(name.encode(), digest_size=16).digest()
    return list(struct.unpack("<4I", digest))


def chunk_values(seed: int, name: str, index: int, count: int, s: Sampler) -> np.ndarray:
    """Values [index*CHUNK, index*CHUNK + count) of tensor `name`, as stored on disk."""
    entropy = [seed & 0xFFFFFFFF, seed >> 32, *_name_words(name), index]
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))
    u = np.frombuffer(rng.bytes(2 * count), dtype="<u2")
    if s.quiet_rows is None:
        return s.table[u]  # both steps release the GIL, so chunks are generated in parallel
    rows = np.arange(index * CHUNK, index * CHUNK + count) // s.row_len
    assert s.quiet_table is not None
    return np.where(s.quiet_rows[rows], s.quiet_table[u], s.table[u])


def tensor_values(seed: int, spec: TensorSpec, init: Init) -> np.ndarray:
    """The whole tensor at once, flattened (tests and small tensors)."""
    s = sampler(spec, init)
    parts = [
        chunk_values(seed, spec.name, i, min(CHUNK, spec.numel - i * CHUNK), s)
        for i in range(max(1, -(-spec.numel // CHUNK)))
    ]
    return np.concatenate(parts)


def plan_shards(specs: list[TensorSpec], max_bytes: int | None = None) -> list[list[TensorSpec]]:
    """Split tensors, in order, into shards of at most max_bytes (a bigger tensor gets its own)."""
    max_bytes = MAX_SHARD_BYTES if max_bytes is None else max_bytes
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def encode_safetensors_header(specs: list[TensorSpec]) -> bytes:
    """8-byte little-endian length + JSON header, padded with spaces to 8 bytes like safetensors."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for s in specs:
        header[s.name] = {
            "dtype": s.dtype,
            "shape": list(s.shape),
            "data_offsets": [offset, offset + s.nbytes],
        }
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


# Swapped by tests to simulate a failure in the middle of writing.
def write_chunk(f: BinaryIO, data: np.ndarray) -> None:
    f.write(memoryview(data).cast("B"))  # type: ignore[arg-type]  # contiguous: no copy


def write_shards(
    directory: Path,
    shards: list[list[TensorSpec]],
    seed: int,
    init: Callable[[TensorSpec], Init],
    progress: Callable[[str, int, int], None] | None = None,
    workers: int | None = None,
) -> dict[str, str]:
    """Write every shard, one chunk at a time; return the weight map (tensor -> file name)."""
    workers = workers or max(1, min(4, os.cpu_count() or 1))
    # Every tensor gets at least one (possibly empty) chunk, so every shard gets opened.
    items = [
        (k, s, c, min(CHUNK, s.numel - c * CHUNK))
        for k, shard in enumerate(shards)
        for s in shard
        for c in range(max(1, -(-s.numel // CHUNK)))
    ]
    total = sum(s.nbytes for shard in shards for s in shard)
    # A few chunks in flight overlap generation with writing; memory stays at a few chunks.
    ahead = 2 * workers + 2
    futures: dict[int, Future[np.ndarray]] = {}
    weight_map: dict[str, str] = {}
    pool = ThreadPoolExecutor(workers, thread_name_prefix="smoe-synth")

    samplers: dict[str, Sampler] = {}

    def submit(j: int) -> None:
        _, s, c, n = items[j]
        if s.name not in samplers:
            samplers.clear()  # one tensor's sampler at a time
            samplers[s.name] = sampler(s, init(s))
        futures[j] = pool.submit(chunk_values, seed, s.name, c, n, samplers[s.name])

    try:
        for j in range(min(ahead, len(items))):
            submit(j)
        j = done = 0
        for k, shard in enumerate(shards):
            name = shard_name(k, len(shards))
            with open(directory / name, "wb") as f:
                f.write(encode_safetensors_header(shard))
                while j < len(items) and items[j][0] == k:
                    if j + ahead < len(items):
                        submit(j + ahead)
                    data = futures.pop(j).result()
                    write_chunk(f, data)
                    done += data.nbytes
                    if progress is not None:
                        progress("weights", done, total)
                    j += 1
                # Durable before the directory is renamed into place.
                f.flush()
                os.fsync(f.fileno())
            weight_map.update((s.name, name) for s in shard)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return weight_map
