"""The read backend for a checkpoint folder: ``ShardReader``, a RecordReader
(``smoe.io.reader``) whose records are read from their original shards.

A record of a ``Source`` (smoe.vault.source) is a few file extents (smoe.vault.source_index:
one for a Hugging Face expert whose tensors sit side by side, one per component for an
mlx-community stacked layout). Each extent is read with O_DIRECT as its aligned superset
(the offset rounded down and the end up to 4 KiB) into an aligned bounce buffer of the
reading thread, and its pieces are copied to their places in the ring's landing. Large
extents are read in parts at once (the worker's and helper threads'), as DirectReader
reads large records. Where O_DIRECT is refused, reads are buffered (``open_direct``).

The worker loop, the queue, ``read()`` and its cancellation, and ``close`` are
RecordReader's, as for a vault. Here: EINTR and EAGAIN retried, short reads continued;
every failure a VaultReadError naming the shard, the layer, the expert and the fix. There
are no checksums to verify (docs/sources.md).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

import numpy as np

from smoe.errors import VaultReadError
from smoe.io.direct_file import (
    MAX_PARTS,
    PART_BYTES,
    READ_ATTEMPTS,
    TRANSIENT_ERRNOS,
    describe_os_error,
    open_vault_file,
)
from smoe.io.hugepages import HUGE_PAGE, advise_huge_pages
from smoe.io.reader import RecordReader, check_reader_args
from smoe.io.ring import ExpertRing
from smoe.vault.source import Source
from smoe.vault.source_index import Extent

BLOCK = 4096  # O_DIRECT's offsets, lengths and buffer addresses are multiples of this
FIX = "check the disk (dmesg) and download the model again, or convert it: smoe convert SRC VAULT"


def _bounce_buffer(n: int) -> np.ndarray:
    """At least ``n`` bytes at a 2 MiB-aligned address, on huge pages where the kernel
    grants them: O_DIRECT into 4 KiB pages runs at ~40% of the rate (smoe.io.hugepages)."""
    n = -(-n // HUGE_PAGE) * HUGE_PAGE
    raw = np.empty(n + HUGE_PAGE, dtype=np.uint8)
    start = (-int(raw.ctypes.data)) % HUGE_PAGE
    buf = raw[start : start + n]
    advise_huge_pages(int(buf.ctypes.data), n)
    buf.fill(0)  # touched now, once, not during the first reads
    return buf


def _chunks(extent: Extent, parts: int) -> list[tuple[int, int]]:
    """[a, b) byte ranges of ``extent`` read at once: ``parts`` of at least PART_BYTES."""
    n = max(1, min(parts, extent.length // PART_BYTES))
    edges = [0] + [extent.length * i // n // BLOCK * BLOCK for i in range(1, n)] + [extent.length]
    return [(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]


def bounce_bytes(source: Source, workers: int, parts: int | None = None) -> int:
    """Host memory a ShardReader of ``workers`` threads keeps for its bounce buffers: one
    per reading thread and part, each the largest part read at once plus two blocks,
    rounded up to huge pages as ``_bounce_buffer`` allocates (counted in --memory)."""
    parts = parts if parts is not None else MAX_PARTS
    largest = max(b - a for ex in source.index.extents for e in ex for a, b in _chunks(e, parts))
    one = -(-(largest + 2 * BLOCK) // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE
    return workers * max(1, parts) * one


class ShardExtents:
    """RecordLocations of a Source: each record is a few extents of its shards, read as
    their aligned supersets into this thread's bounce buffer and copied into place.
    ``reads`` counts the extent reads issued (parts of one count once), ``records`` the
    records read; ``spare`` holds the bounce buffers made at open, one per reading thread."""

    def __init__(
        self, source: Source, workers: int, direct: bool = True, parts: int | None = None
    ) -> None:
        self.source = source
        self.index = source.index
        self.num_records = len(self.index.extents)
        self.stride = source.manifest.record.stride
        self.reads = 0  # extent reads issued
        self.records = 0  # records read
        self._count_lock = threading.Lock()
        self.parts = parts if parts is not None else MAX_PARTS
        self.helpers_per_worker = max(0, self.parts - 1)
        self._buffers = threading.local()
        self.fds: list[int] = []
        self.direct = True
        try:
            for f in self.index.files:
                fd, direct_ok = open_vault_file(f, direct)
                self.fds.append(fd)
                self.direct = self.direct and direct_ok
        except BaseException:
            self.close()
            raise
        # One bounce buffer per reading thread, made now: not during the first reads.
        largest = max(
            b - a for ex in self.index.extents for e in ex for a, b in _chunks(e, self.parts)
        )
        self.spare = [
            _bounce_buffer(largest + 2 * BLOCK) for _ in range(workers * max(1, self.parts))
        ]

    def fill(
        self, view: memoryview, record: int, helpers: concurrent.futures.ThreadPoolExecutor
    ) -> None:
        """Blocking: every extent of ``record`` into ``view`` (the slot's landing). The
        first part is read here, the others on ``helpers`` at once; returns once all
        have finished (the first error raised)."""
        extents = self.index.extents[record]
        with self._count_lock:
            self.reads += len(extents)
            self.records += 1
        dest = np.frombuffer(view, dtype=np.uint8)
        work = [(e, a, b) for e in extents for a, b in _chunks(e, self.parts)]
        rest = [helpers.submit(self._read_part, dest, record, *w) for w in work[1:]]
        try:
            self._read_part(dest, record, *work[0])
        finally:
            concurrent.futures.wait(rest)  # no thread writes into the landing after
        for h in rest:
            h.result()

    def _bounce(self, n: int) -> np.ndarray:
        """This thread's bounce buffer, of at least ``n`` bytes: one made when the reader
        opened (sized for the largest part), grown only if needed."""
        buf: np.ndarray | None = getattr(self._buffers, "buf", None)
        if buf is None:
            with self._count_lock:
                buf = self.spare.pop() if self.spare else None
        if buf is None or len(buf) < n:
            buf = _bounce_buffer(n)
        self._buffers.buf = buf
        return buf

    def _read_part(self, dest: np.ndarray, record: int, extent: Extent, a: int, b: int) -> None:
        """Bytes [a, b) of ``extent``: its aligned superset read into this thread's bounce
        buffer, then each piece's share copied to its place in ``dest``."""
        start, end = extent.offset + a, extent.offset + b
        lo = start - start % BLOCK
        hi = -(-end // BLOCK) * BLOCK
        buf = self._bounce(hi - lo)
        self._read_span(buf[: hi - lo], record, extent.file, lo, end - lo)
        for p in extent.pieces:
            s, t = max(a, p.src), min(b, p.src + p.nbytes)
            if s < t:
                dest[p.dst + s - p.src : p.dst + t - p.src] = buf[
                    s - a + start - lo : t - a + start - lo
                ]

    def _read_span(self, buf: np.ndarray, record: int, file: int, offset: int, need: int) -> None:
        """At least ``need`` bytes of file ``file`` from ``offset`` (aligned) into ``buf``.
        Short reads continue (O_DIRECT's come in whole blocks, but at the file's end);
        EINTR and EAGAIN are retried up to READ_ATTEMPTS times in a row without progress;
        anything else, or the file's end, is a VaultReadError."""
        fd, done, stalled = self.fds[file], 0, 0
        while done < need:
            try:
                n = os.preadv(fd, [buf[done:].data], offset + done)
            except OSError as e:
                stalled += 1
                if e.errno in TRANSIENT_ERRNOS and stalled < READ_ATTEMPTS:
                    continue
                raise self._error(record, file, describe_os_error(e), e.errno) from e
            if n == 0:
                raise self._error(
                    record, file, f"the file ends at byte {offset + done}: truncated", None
                )
            if done + n >= need:
                return
            if self.direct and n % BLOCK:  # O_DIRECT returns part of a block only at the end
                raise self._error(
                    record, file, f"the file ends at byte {offset + done + n}: truncated", None
                )
            done += n
            stalled = 0

    def _error(self, record: int, file: int, what: str, cause: int | None) -> VaultReadError:
        layer, expert = self.source.manifest.record_key(record)
        path = self.index.files[file]
        return VaultReadError(
            f"{path}: reading expert {expert} of layer {layer} failed: {what}; {FIX}",
            path=path,
            record=record,
            key=(layer, expert),
            errno=cause,
        )

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def describe(self) -> str:
        mode = "direct" if self.direct else "buffered"
        return f"{self.source.path}, {len(self.index.files)} shards, {mode}"


class ShardReader(RecordReader):
    """ReadBackend for a Source and a ring: ``await read(record, slot)`` fills the slot
    from the shards (``RecordReader.read``: its errors and cancellation). ``reads`` counts
    the extent reads issued. Close it (or use it as a context manager) to stop the threads
    and close the files."""

    def __init__(
        self,
        source: Source,
        ring: ExpertRing,
        workers: int = 4,
        direct: bool = True,
        parts: int | None = None,
    ) -> None:
        check_reader_args(workers, ring, source.manifest.record.stride)  # before opening
        self.shards = ShardExtents(source, workers, direct, parts)
        try:
            super().__init__(self.shards, ring, workers)
        except BaseException:
            self.shards.close()
            raise

    @property
    def reads(self) -> int:
        return self.shards.reads
