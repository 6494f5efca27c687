"""`smoe bench io`: the streamer's read throughput beside a raw O_DIRECT preadv baseline.

Cold random reads of whole records from a real vault. For each worker count, in one run:
- baseline: N plain threads, each preadv-ing whole records (random order) into its own
  aligned buffer with O_DIRECT, no scheduler, no ring;
- streamer: S-MoE's ExpertScheduler + DirectReader with N workers filling ring slots,
  driven by clients that acquire decode-sized batches of experts (all misses) and release.
  On the unified path reads land in the slots; on the staged path they land in host
  buffers that another thread commits into the device arrays (disk -> staging -> device),
  and the run ends when the last record is on the device.
With ``busy``, spinning processes occupy the CPUs during both, as compute does. The
streamer verifies each record's checksum as the engine does (``verify=False``: not, to
measure what verification costs); the baseline never does.
Both read the same number of records of the same size at the same concurrency, into the
same kind of memory (16 KiB-aligned, backed by huge pages where the kernel allows, as many
landing buffers as the ring has slots: one reused buffer reads faster than a ring). The two run
back to back, alternating which goes first, so drift in the disk hits both. Page cache:
O_DIRECT bypasses it; the file's cached pages are also dropped (fadvise) before each run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import multiprocessing
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smoe.errors import SmoeError
from smoe.io.direct import DirectReader
from smoe.io.direct_file import open_direct, split_record
from smoe.io.disk_probe import RunResult, baseline_run, drop_file_cache
from smoe.io.staged import StagedRing
from smoe.io.unified import UnifiedRing
from smoe.sched.scheduler import ExpertScheduler
from smoe.vault.format import Vault


class _CommitThread:
    """A thread that owns a staged ring's MLX work, as the engine's compute thread does:
    it builds the ring and commits landed records until told to stop."""

    def __init__(self, build: Any) -> None:
        self._made: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._stop: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(build,), name="bench-commit")
        self._thread.start()
        self.ring = self._made.result()

    def _run(self, build: Any) -> None:
        try:
            ring = build()
        except BaseException as e:
            self._made.set_exception(e)
            return
        self._made.set_result(ring)
        ring.block_on(self._stop)

    def stop(self) -> None:
        """Commit what has landed, then end the thread."""
        self._stop.set_result(None)
        self._thread.join()


def bench_ring(
    vault: Vault, path: str, slots: int, workers: int
) -> tuple[Any, _CommitThread | None]:
    """The ring of ``path`` ('unified' or 'staged', as the engine builds it on this
    device), and for a staged ring the thread committing its landings."""
    import mlx.core as mx

    m = vault.manifest
    if path == "unified":
        return UnifiedRing(m.record, slots), None
    gpu = mx.default_device() == mx.gpu
    discrete = gpu and not mx.metal.is_available()
    dtype = mx.bfloat16 if gpu else mx.float32

    def build() -> StagedRing:
        return StagedRing.for_vault(m, slots, dtype, workers=workers, gpu=gpu, discrete=discrete)

    committer = _CommitThread(build)
    return committer.ring, committer


async def _streamer(
    vault: Vault,
    records: list[int],
    workers: int,
    slots: int,
    batch: int,
    path: str,
    parts: int | None = None,
    verify: bool = True,
) -> RunResult:
    m = vault.manifest
    ring, committer = bench_ring(vault, path, slots, workers)
    reader = DirectReader(vault, ring, workers=workers, parts=parts, verify=verify)
    sched = ExpertScheduler(
        slots,
        reader,
        record_of=lambda k: m.record_index(*k),
        record_bytes=m.record.stride,
        workers=workers,
        runway=workers,  # as the engine runs it
    )
    keys = [m.record_key(r) for r in records]
    batches = [keys[i : i + batch] for i in range(0, len(keys), batch)]
    todo = iter(batches)
    # Enough clients that the queue never runs dry: each holds one batch at a time.
    clients = max(2, math.ceil(2 * workers / batch) + 1)
    clients = min(clients, max(1, slots // batch))

    async def client() -> None:
        for group in todo:
            # The batch's records all at once, one acquire per layer, as a decode step asks
            # for a layer's experts together: the streamer gets the baseline's concurrency.
            by_layer: dict[int, list[int]] = {}
            for lyr, e in group:
                by_layer.setdefault(lyr, []).append(e)
            got = await asyncio.gather(*(sched.acquire(lyr, es) for lyr, es in by_layer.items()))
            for g in got:
                sched.release(g)

    try:
        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        if committer is not None:  # the staged path ends when the last record is on device
            await asyncio.to_thread(committer.stop)
            committer = None
        seconds = time.perf_counter() - start
    finally:
        if committer is not None:
            committer.stop()
        ring.close()
        await sched.close()
        reader.close()
    reads = sched.stats.by_priority
    total = sum(c.bytes for c in reads.values())
    return RunResult(len(records), total, seconds)


def streamer_run(
    vault: Vault,
    records: list[int],
    workers: int,
    slots: int,
    batch: int,
    path: str = "unified",
    parts: int | None = None,
    verify: bool = True,
) -> RunResult:
    from smoe.util.loop import run

    return run(_streamer(vault, records, workers, slots, batch, path, parts, verify))


def _spin() -> None:  # pragma: no cover - runs in a child process until terminated
    while True:
        pass


class BusyCPUs:
    """``n`` processes spinning on the CPUs while the block runs (as compute does)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._procs: list[multiprocessing.process.BaseProcess] = []

    def __enter__(self) -> BusyCPUs:
        ctx = multiprocessing.get_context("spawn")
        for _ in range(self.n):
            proc = ctx.Process(target=_spin, daemon=True)
            proc.start()
            self._procs.append(proc)
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self._procs:
            proc.terminate()
        for proc in self._procs:
            proc.join()


def bench_io(
    vault_path: Path | str,
    workers: list[int],
    reads: int | None = None,
    repeats: int = 4,
    batch: int = 8,
    slots: int = 64,
    seed: int = 0,
    paths: tuple[str, ...] = ("unified",),
    busy: tuple[int, ...] = (0,),
    parts: tuple[int | None, ...] = (None,),
    verify: bool = True,
    control: bool = False,
) -> dict[str, Any]:
    """Run the sweep; return the JSON-able report. ``paths``: the rings to measure
    ('unified': reads land in the slots; 'staged': host landings committed into device
    arrays by another thread). ``busy``: numbers of spinning processes to run beside.
    ``parts``: how many parts the streamer reads each record in (None: DirectReader's
    default), one sweep per value. ``verify``: whether the streamer checks each record's
    checksum (the engine always does; off only to measure its cost). ``control``: also time a
    second baseline in each repeat, so ``control_ratio`` (baseline / baseline) shows how far
    two identical runs differ on this disk: the noise floor of ``ratio``."""
    unknown = set(paths) - {"unified", "staged"}
    if unknown:
        raise SmoeError(f"unknown path {sorted(unknown)[0]!r}: use unified, staged or both")
    vault = Vault.open(vault_path)
    m = vault.manifest
    n = min(reads or m.num_records, m.num_records)
    sweep = _Sweep(vault, n, repeats, batch, slots, random.Random(seed), verify, control)
    for path in paths:  # untimed: first-use costs (thread start, kernel compilation) go here
        sample = sweep.rng.sample(range(m.num_records), min(8, n))
        streamer_run(vault, sample, 2, slots, batch, path, verify=verify)
    rows = []
    for load in busy:
        with BusyCPUs(load):
            for path in paths:
                for p in parts:
                    for w in workers:
                        rows.append(_sweep_row(sweep, w, path, p) | {"busy_processes": load})
    fd, direct = open_direct(vault.experts_path)
    os.close(fd)
    return {
        "benchmark": "io",
        "vault": str(vault.path),
        "record_bytes": m.record.size,
        "read_bytes": m.record.stride,
        "records_per_run": n,
        "bytes_per_run": n * m.record.stride,
        "repeats": repeats,
        "batch": batch,
        "ring_slots": slots,
        "direct_io": direct,
        "verify": verify,
        "control": control,
        "checksum_algorithm": m.checksum_algorithm,
        "ring_huge_pages": UnifiedRing(m.record, 1).huge_pages,
        "cpus": os.cpu_count(),
        "sweep": rows,
        "best": max(rows, key=lambda r: r["streamer_GBps"]),
    }


@dataclass
class _Sweep:
    """What every row of one ``bench_io`` sweep shares."""

    vault: Vault
    records: int  # read per run
    repeats: int
    batch: int
    slots: int
    rng: random.Random
    verify: bool
    control: bool


def _timed_runs(sweep: _Sweep, w: int, path: str, parts: int | None) -> dict[str, list[RunResult]]:
    """``repeats`` runs of each kind at ``w`` workers, each over a fresh random order."""
    vault, slots = sweep.vault, sweep.slots
    stride = vault.manifest.record.stride
    runs: dict[str, list[RunResult]] = {"baseline": [], "streamer": [], "control": []}
    for rep in range(sweep.repeats):
        order = sweep.rng.sample(range(vault.manifest.num_records), sweep.records)
        # ABBA order: a disk that speeds up or slows down over time hits both alike. The
        # control (a second baseline) mirrors the baseline around the streamer.
        kinds = ["baseline", "streamer"] if rep % 2 == 0 else ["streamer", "baseline"]
        if sweep.control:
            kinds = ["baseline", "streamer", "control"]
            kinds = kinds if rep % 2 == 0 else kinds[::-1]
        for kind in kinds:
            drop_file_cache(vault.experts_path)
            if kind in ("baseline", "control"):
                # Landing in as many buffers as the ring has slots, as the streamer must: one
                # reused buffer per thread reads ~30% faster at 1 worker (bench/io_landing.py).
                result = baseline_run(vault.experts_path, stride, order, w, max(1, slots // w))
            else:
                result = streamer_run(
                    vault, order, w, slots, sweep.batch, path, parts, sweep.verify
                )
            runs[kind].append(result)
    return runs


def _sweep_row(sweep: _Sweep, w: int, path: str, parts: int | None) -> dict[str, Any]:
    runs = _timed_runs(sweep, w, path, parts)

    def rate(kind: str) -> float:
        return sum(r.bytes for r in runs[kind]) / sum(r.seconds for r in runs[kind]) / 1e9

    b, s = rate("baseline"), rate("streamer")
    row = {
        "path": path,
        "workers": w,
        "read_parts": len(split_record(sweep.vault.manifest.record.stride, parts)),
        "baseline_buffers_per_thread": max(1, sweep.slots // w),
        "verify": sweep.verify,
        "baseline_GBps": round(b, 3),
        "streamer_GBps": round(s, 3),
        "ratio": round(s / b, 3),
        "baseline_runs_GBps": [round(r.gbps, 3) for r in runs["baseline"]],
        "streamer_runs_GBps": [round(r.gbps, 3) for r in runs["streamer"]],
        "ratio_runs": [
            round(sr.gbps / br.gbps, 3)
            for sr, br in zip(runs["streamer"], runs["baseline"], strict=True)
        ],
    }
    if sweep.control:
        row["control_GBps"] = round(rate("control"), 3)
        row["control_ratio"] = round(rate("control") / b, 3)
        row["control_ratio_runs"] = [
            round(cr.gbps / br.gbps, 3)
            for cr, br in zip(runs["control"], runs["baseline"], strict=True)
        ]
    return row
