"""How fast the disk under a model reads, measured the way the engine reads it.

``baseline_run``: N threads of O_DIRECT ``preadv`` of whole records into aligned memory
(the reader's own read size and kind of buffer; no scheduler, no ring). ``probe_disk``: a
few seconds of that at one worker count, in rounds whose spread is kept, cached per block
device, record size and worker count in the cache directory's ``disk-probe.json``.
``probe_workers`` / ``auto_workers``: the worker count a disk rewards (``--workers auto``).

The cache is a file anyone can edit: an entry is used only if it holds three positive
rates, else the disk is measured again. Every probe raises OSError if the file cannot be
read; ``auto_workers`` turns that into the default count and a line saying why.
"""

from __future__ import annotations

import json
import os
import queue
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from smoe.io.direct_file import open_direct
from smoe.io.hugepages import HUGE_PAGE, advise_huge_pages
from smoe.util.cache import cache_dir
from smoe.util.files import file_lock, write_json_atomic

DISK_FILE = "disk-probe.json"
DEFAULT_WORKERS = 4  # I/O threads where none are asked for and the disk is not probed


@dataclass
class RunResult:
    """What one timed run read: records, bytes, seconds."""

    records: int
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9


def drop_file_cache(path: Path) -> None:
    """Ask the kernel to forget the file's cached pages (no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def baseline_run(
    path: Path, stride: int, records: list[int], workers: int, buffers: int = 1
) -> RunResult:
    """N threads of raw preadv over a shared list of record indices. Each thread lands its
    reads in ``buffers`` buffers in turn (1: the same one every time)."""
    fd, _ = open_direct(path)
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for r in records:
        todo.put(r)
    errors: list[BaseException] = []

    def worker() -> None:
        # The same kind of memory as the ring: aligned for O_DIRECT, on huge pages.
        raw = np.zeros(buffers * stride + HUGE_PAGE, dtype=np.uint8)
        start = (-int(raw.ctypes.data)) % HUGE_PAGE
        advise_huge_pages(int(raw.ctypes.data), raw.nbytes)
        whole = raw[start : start + buffers * stride].data
        turn = 0
        try:
            while True:
                try:
                    r = todo.get_nowait()
                except queue.Empty:
                    return
                view = whole[(turn % buffers) * stride : (turn % buffers + 1) * stride]
                turn += 1
                done = 0
                while done < stride:
                    n = os.preadv(fd, [view[done:]], r * stride + done)
                    if n <= 0:
                        raise OSError(f"short read at record {r}")
                    done += n
        except BaseException as e:  # reported after join
            errors.append(e)
        finally:
            whole.release()

    threads = [threading.Thread(target=worker, name=f"baseline-{i}") for i in range(workers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    os.close(fd)
    if errors:
        raise errors[0]
    return RunResult(len(records), len(records) * stride, seconds)


def read_json_object(path: Path) -> dict[str, Any]:
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
    known = read_json_object(cache).get(key)
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
        write_json_atomic(cache, read_json_object(cache) | {key: result})
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
