"""The compute measurement `smoe plan` forecasts from (docs/plan.md); the disk's is
``smoe.io.disk_probe`` (the engine uses it too, for ``--workers auto``).

- the compute: an engine on the vault with the planned ring decodes a few short requests
  after one that warms it; the time it did not spend waiting for reads, per token, is the
  compute per token, the scheduler's and the reads' CPU work included (one figure per
  request: their spread is the band's). Prefill: the time of a prompt's chunks less its
  reads at the probed disk rate. Recorded in the vault's ``stats/compute.json`` per
  device, dtype, ring size and host, and reused unless asked afresh.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from typing import Any

from smoe.io.disk_probe import read_json_object
from smoe.util.files import file_lock, write_json_atomic
from smoe.vault.format import Vault

COMPUTE_FILE = "compute.json"
PROBE_TOKENS = 6  # decoded tokens a probe request measures (one more is generated)


def compute_key(device: str, dtype: str, slots: int) -> str:
    return f"{device}:{dtype}:slots{slots}:{platform.node()}"


def recorded_compute(vault: Vault, device: str, dtype: str, slots: int) -> dict[str, Any] | None:
    """The compute figures a probe recorded in the vault for this device, dtype, ring size
    and host."""
    found = read_json_object(vault.stats_dir / COMPUTE_FILE).get(compute_key(device, dtype, slots))
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
    tokens: int = PROBE_TOKENS,
    chunks: int = 2,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Compute per decode token and per prefill token on ``device`` with a ring of
    ``slots`` (module docstring), recorded in the vault. A ring of every expert is filled
    first: its figures are the resident rate (device tables, no host round trip). Opens
    an engine (SmoeError as Engine.open). ``progress`` is told, after the warm-up
    request, how long the measured ones should take (each about as long as it)."""
    from smoe.engine import Engine
    from smoe.forecast.workload import fill_ring, random_prompt

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
            start = time.perf_counter()
            async for ev in engine.generate(prompt, max_tokens=tokens + 1, stop_at_eos=False):
                stats = ev.stats or stats
            if i == 0 and progress is not None:  # it compiled too: the estimate errs long
                took = time.perf_counter() - start
                progress(
                    f"the warm-up request took {took:.1f} s: about {requests * took:.0f} s "
                    f"more for the {requests} measured"
                )
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
            write_json_atomic(path, read_json_object(path) | {key: result})
    except OSError:  # a read-only vault: the figure is still used, just not kept
        pass
    return result | {"device": device, "dtype": dtype, "recorded": False}
