"""The two measurements `smoe plan` forecasts from (docs/plan.md):

- the disk: a few seconds of O_DIRECT random reads of record-sized extents of the model's
  file at the engine's worker count (``smoe.bench.io.baseline_run``, the reader's own
  machinery), in rounds whose spread is reported; cached per block device, record size
  and worker count in the cache directory's ``disk-probe.json``;
- the compute: an engine on the vault with the planned ring decodes a few short requests
  after one that warms it; the time it did not spend waiting for reads, per token, is the
  compute per token, the scheduler's and the reads' CPU work included (one figure per
  request: their spread is the band's). Prefill: the time of a prompt's chunks less its
  reads at the probed disk rate. Recorded in the vault's ``stats/compute.json`` per
  device, dtype, ring size and host, and reused unless asked afresh.
"""

from __future__ import annotations

import json
import os
import platform
import random
import time
from pathlib import Path
from typing import Any

from smoe.bench.io import baseline_run, drop_file_cache
from smoe.chat.demo import cache_dir
from smoe.engine.options import DEFAULT_WORKERS
from smoe.util.files import file_lock, write_json_atomic
from smoe.vault.format import Vault

DISK_FILE = "disk-probe.json"
COMPUTE_FILE = "compute.json"


def _read_json(path: Path) -> dict[str, Any]:
    """A cache file's object; an unreadable one is treated as empty (it is only a cache)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _valid_rates(known: Any) -> bool:
    """Whether a cached probe entry holds three positive rates (the cache is a file: a
    damaged or edited entry is measured afresh, never trusted)."""
    if not isinstance(known, dict):
        return False
    rates = [known.get(k) for k in ("gbps_low", "gbps", "gbps_high")]
    return all(isinstance(r, int | float) and not isinstance(r, bool) and r > 0 for r in rates)


def disk_key(path: Path, stride: int, workers: int) -> str:
    """Which device a probe measured: the block device's number, the read size, workers."""
    return f"dev{os.stat(path).st_dev}:stride{stride}:workers{workers}"


def probe_disk(
    path: Path,
    stride: int,
    workers: int,
    *,
    seconds: float = 3.0,
    rounds: int = 3,
    fresh: bool = False,
    cache: Path | None = None,
) -> dict[str, Any]:
    """GB/s of random O_DIRECT reads of ``stride``-byte extents of ``path`` with
    ``workers`` threads: {"gbps_low", "gbps", "gbps_high", "cached"} (the slowest, median
    and fastest of ``rounds`` rounds of about ``seconds`` / ``rounds`` each). A cached
    figure for the same device, stride and workers is returned unless ``fresh``.
    Raises OSError if the file cannot be read."""
    cache = cache or cache_dir() / DISK_FILE
    key = disk_key(path, stride, workers)
    known = _read_json(cache).get(key)
    if not fresh and isinstance(known, dict) and _valid_rates(known):
        return dict(known) | {"cached": True}
    extents = max(1, os.stat(path).st_size // stride)
    rng = random.Random(0)
    rates: list[float] = []
    every: list[float] = []  # a small file's rounds may all be too short to count
    count = max(workers * 2, 8)  # a first small round sizes the others
    budget = seconds / rounds
    drop_file_cache(path)
    for _ in range(rounds + 1):
        order = [rng.randrange(extents) for _ in range(count)]
        run = baseline_run(path, stride, order, workers)
        every.append(run.gbps)
        if run.seconds > 0.05 or count >= 4 * extents:
            rates.append(run.gbps)
        count = max(workers, min(4 * extents, int(count * budget / max(run.seconds, 1e-3))))
        drop_file_cache(path)  # a repeated extent must come from the disk again
    rates = sorted((rates or every)[-rounds:])
    result = {
        "gbps_low": round(rates[0], 4),
        "gbps": round(rates[len(rates) // 2], 4),
        "gbps_high": round(rates[-1], 4),
        "stride": stride,
        "workers": workers,
        "file": str(path),
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    cache.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(cache.with_suffix(".lock")):
        write_json_atomic(cache, _read_json(cache) | {key: result})
    return result | {"cached": False}


# Worker counts the engine tries on a disk it has not seen (--workers auto), and what a
# larger count must gain to be worth its threads and landing buffers.
WORKER_CANDIDATES = (1, 2, 4, 8, 16)
WORTH = 0.05
# Below this size a model's experts are resident or cached: reads do not set the speed,
# and no probe is run (the demo, the tests' checkpoints).
AUTO_PROBE_MIN_BYTES = 1 << 30


def choose_workers(gbps: dict[int, float], worth: float = WORTH) -> int:
    """The fewest workers whose rate is within ``worth`` of the best rate measured."""
    best = max(gbps.values())
    return min(w for w, rate in gbps.items() if rate >= best * (1 - worth))


def probe_workers(
    path: Path,
    stride: int,
    *,
    candidates: tuple[int, ...] = WORKER_CANDIDATES,
    seconds: float = 0.6,
    fresh: bool = False,
    cache: Path | None = None,
) -> dict[str, Any]:
    """Random O_DIRECT reads of ``stride``-byte extents of ``path`` at each worker count in
    ``candidates`` (ascending, each ``probe_disk``'s, cached per device), stopping once two
    counts in a row gain less than ``WORTH``: {"workers": the choice, "gbps": {w: rate},
    "cached": whether every rate came from the cache}. Raises OSError like probe_disk."""
    gbps: dict[int, float] = {}
    cached = True
    stalled = 0
    for w in sorted(candidates):
        r = probe_disk(path, stride, w, seconds=seconds, rounds=2, fresh=fresh, cache=cache)
        cached = cached and bool(r["cached"])
        best = max(gbps.values(), default=0.0)
        gbps[w] = float(r["gbps"])
        stalled = stalled + 1 if gbps[w] < best * (1 + WORTH) else 0
        if stalled == 2:
            break
    return {"workers": choose_workers(gbps), "gbps": gbps, "cached": cached}


def auto_workers(path: Path, stride: int, size: int) -> tuple[int, str | None]:
    """I/O workers for a model whose experts (``size`` bytes) sit in ``path``, and one line
    saying how they were chosen (None: not probed). A model under AUTO_PROBE_MIN_BYTES
    gets DEFAULT_WORKERS unprobed; so does a disk that cannot be probed (the reads will
    then say what is wrong, with their own error)."""
    if size < AUTO_PROBE_MIN_BYTES:
        return DEFAULT_WORKERS, None
    try:
        found = probe_workers(path, stride)
    except OSError as e:
        reason = e.strerror or e
        return DEFAULT_WORKERS, f"{DEFAULT_WORKERS} I/O workers (the disk probe failed: {reason})"
    rates = ", ".join(f"{w}: {g:.2f}" for w, g in found["gbps"].items())
    how = "cached" if found["cached"] else "measured"
    return found[
        "workers"
    ], f"{found['workers']} I/O workers (disk GB/s by workers, {how}: {rates})"


def compute_key(device: str, dtype: str, slots: int) -> str:
    return f"{device}:{dtype}:slots{slots}:{platform.node()}"


def recorded_compute(vault: Vault, device: str, dtype: str, slots: int) -> dict[str, Any] | None:
    """The compute figures a probe recorded in the vault for this device, dtype, ring size
    and host."""
    found = _read_json(vault.stats_dir / COMPUTE_FILE).get(compute_key(device, dtype, slots))
    return dict(found) if isinstance(found, dict) and "decode_s" in found else None


async def probe_compute(
    vault: Vault,
    *,
    device: str,
    dtype: str,
    slots: int,
    disk_gbps: float,
    workers: int = 4,
    requests: int = 4,
    tokens: int = 6,
    chunks: int = 2,
    seed: int = 0,
) -> dict[str, Any]:
    """Compute per decode token and per prefill token on ``device`` with a ring of
    ``slots`` (module docstring), recorded in the vault. A ring of every expert is filled
    first: its figures are the resident rate (device tables, no host round trip). Opens
    an engine (SmoeError as Engine.open)."""
    from smoe.bench.generate import random_prompt
    from smoe.bench.resident import fill_ring
    from smoe.engine import Engine

    m = vault.manifest
    slots = max(m.shape.experts_per_token, min(slots, m.num_records))
    decode: list[float] = []
    prefill: list[float] = []
    hits: list[float] = []  # decode hit rate per request: this ring on this model's routing
    records: list[float] = []  # records read per decoded token (misses and lookahead's guesses)
    chunk_records: list[float] = []  # records read per prefill chunk
    options: dict[str, Any] = {"slots": slots, "workers": workers, "dtype": dtype}
    async with Engine.open(vault.path, device=device, **options) as engine:
        chunk = engine.options.prefill_chunk
        if slots >= m.num_records:
            await fill_ring(engine)
        for i in range(requests + 1):  # the first warms the ring and compiles: not counted
            prompt = random_prompt(vault, chunks * chunk + 1, seed + i)
            stats = None
            async for ev in engine.generate(prompt, max_tokens=tokens + 1, stop_at_eos=False):
                stats = ev.stats or stats
            if i == 0 or stats is None or not stats.decode_tok_s:
                continue
            # a staged ring's copies happen inside the waits, but they are the compute
            # thread's work: counted as compute
            busy = 1 - stats.decode_io_wait_share + stats.decode_copy_share
            decode.append(busy / stats.decode_tok_s)
            hits.append(stats.decode_hit_rate)
            records.append(stats.decode_bytes_per_token / m.record.stride)
            chunk_count = max(1, -(-stats.prefilled_tokens // chunk))
            chunk_records.append(stats.prefill_bytes / m.record.stride / chunk_count)
            reads = stats.prefill_bytes / (disk_gbps * 1e9)
            prefill_s = stats.prefilled_tokens / max(stats.prefill_tok_s, 1e-9)
            prefill.append(max(prefill_s - reads, 0.0) / max(stats.prefilled_tokens, 1))
    result: dict[str, Any] = {
        "decode_s": [round(x, 6) for x in sorted(decode)],
        "prefill_token_s": [round(x, 7) for x in sorted(prefill)],
        "decode_hit_rate": [round(x, 4) for x in sorted(hits)],
        "decode_reads_per_token": [round(x, 3) for x in sorted(records)],
        "prefill_reads_per_chunk": [round(x, 2) for x in sorted(chunk_records)],
        "slots": slots,
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path = vault.stats_dir / COMPUTE_FILE
    try:
        path.parent.mkdir(exist_ok=True)
        with file_lock(path.with_suffix(".lock")):
            key = compute_key(device, dtype, slots)
            write_json_atomic(path, _read_json(path) | {key: result})
    except OSError:  # a read-only vault: the figure is still used, just not kept
        pass
    return result | {"device": device, "dtype": dtype, "recorded": False}
