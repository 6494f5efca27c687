"""The direct-I/O read backend: worker threads that preadv() whole records for ring slots.

One read = one record = one slot: ``os.preadv(fd, [ring.landing(slot)], record * stride)``.
The destination (the slot itself, or a host landing buffer of a staged ring) and the file
offset are 16 KiB-aligned and the length is the stride (a 16 KiB multiple), so O_DIRECT's
alignment rules hold and the page cache is bypassed: measured throughput is the SSD's.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import errno
import logging
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

from smoe.io.ring import ExpertRing
from smoe.vault.format import RECORD_ALIGN, Vault

if TYPE_CHECKING:
    from smoe.sched.types import ReadBackend

log = logging.getLogger(__name__)


class BufferedIOWarning(RuntimeWarning):
    """The vault is read through the page cache: direct I/O was refused or unavailable."""


class VaultReadError(OSError):
    """Reading one record failed. The message names the file, record, layer and expert.

    ``errno`` is the underlying error's (None for a truncated file); ``record`` and
    ``key`` (layer, expert) say which expert; ``path`` is the vault file.
    """

    def __init__(
        self,
        message: str,
        *,
        path: Path,
        record: int,
        key: tuple[int, int],
        cause_errno: int | None = None,
    ) -> None:
        super().__init__(message)
        self.errno = cause_errno  # OSError's str() still shows the message: strerror is unset
        self.path = path
        self.record = record
        self.key = key


def _warn_buffered(path: Path, why: str) -> None:
    warnings.warn(
        f"{path}: {why}; reading it through the page cache instead (buffered I/O): expert "
        "reads may be served from RAM and cost extra memory, so speed and memory figures "
        "are not representative of the SSD",
        BufferedIOWarning,
        stacklevel=3,
    )


def _probe_direct(fd: int) -> None:
    """Read the first 16 KiB through ``fd``; raises OSError (EINVAL) if O_DIRECT is refused."""
    raw = np.empty(2 * RECORD_ALIGN, dtype=np.uint8)
    start = (-int(raw.ctypes.data)) % RECORD_ALIGN  # O_DIRECT needs an aligned buffer
    os.preadv(fd, [raw[start : start + RECORD_ALIGN].data], 0)


def open_direct(path: Path | str, direct: bool = True) -> tuple[int, bool]:
    """Open ``path`` read-only for uncached reads; return (fd, whether reads bypass the cache).

    Linux: O_DIRECT, checked with one aligned 16 KiB read, since some filesystems accept the
    flag at open and refuse the reads (EINVAL). macOS: F_NOCACHE. Where neither works, or with
    ``direct=False`` (no warning then), the file is opened buffered; a BufferedIOWarning
    names the file and the consequence. Raises OSError (FileNotFoundError, ...) when the
    file cannot be opened at all. The caller closes the fd.
    """
    path = Path(path)
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    if not direct:
        return os.open(path, flags), False
    o_direct = getattr(os, "O_DIRECT", 0)
    if o_direct:
        try:
            fd = os.open(path, flags | o_direct)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            _warn_buffered(path, "the filesystem refuses O_DIRECT at open (EINVAL)")
            return os.open(path, flags), False
        try:
            _probe_direct(fd)
        except OSError as e:
            os.close(fd)
            if e.errno != errno.EINVAL:
                raise
            _warn_buffered(path, "the filesystem refuses O_DIRECT reads (EINVAL)")
            return os.open(path, flags), False
        return fd, True
    fd = os.open(path, flags)
    f_nocache = getattr(fcntl, "F_NOCACHE", None) if fcntl is not None else None
    if f_nocache is not None:
        try:
            fcntl.fcntl(fd, f_nocache, 1)
            return fd, True
        except OSError as e:
            _warn_buffered(path, f"F_NOCACHE failed ({e.strerror})")
            return fd, False
    _warn_buffered(path, "this platform has neither O_DIRECT nor F_NOCACHE")
    return fd, False


@dataclass(eq=False)
class _Job:
    record: int
    slot: int
    future: concurrent.futures.Future[int]


class _ReadQueue:
    """The reads handed to the workers: two FIFO queues, demand taken before speculation.

    Thread-safe. A worker takes its next read here the moment it finishes one, without a
    round trip through the event loop (which, measured, cost up to a third of the disk's
    rate at one worker with busy CPUs).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queues: tuple[collections.deque[_Job], ...] = (
            collections.deque(),
            collections.deque(),
        )
        self._closed = False

    def put(self, job: _Job, priority: int) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("DirectReader is closed")
            self._queues[min(max(priority, 0), 1)].append(job)
            self._cond.notify()

    def take(self) -> _Job | None:
        """The next read (blocking), or None once closed."""
        with self._cond:
            while not self._closed:
                for q in self._queues:
                    if q:
                        return q.popleft()
                self._cond.wait()
            return None

    def remove(self, job: _Job) -> bool:
        """Take ``job`` back if no worker has started it; True if it was still queued."""
        with self._cond:
            for q in self._queues:
                if job in q:
                    q.remove(job)
                    return True
            return False

    def close(self) -> list[_Job]:
        """Stop handing out reads; return those still queued."""
        with self._cond:
            self._closed = True
            dropped = [job for q in self._queues for job in q]
            for q in self._queues:
                q.clear()
            self._cond.notify_all()
            return dropped


PART_BYTES = 2 << 20  # a record is read in parts of at least this much, at most MAX_PARTS
MAX_PARTS = 4


def split_record(stride: int, parts: int | None = None) -> list[tuple[int, int]]:
    """[start, end) byte ranges a record of ``stride`` bytes is read in: ``parts`` of them
    (default: one per PART_BYTES, at most MAX_PARTS), each a multiple of 16 KiB as
    O_DIRECT needs."""
    blocks = stride // RECORD_ALIGN
    n = parts if parts is not None else min(MAX_PARTS, max(1, stride // PART_BYTES))
    n = max(1, min(n, blocks))
    edges = [blocks * i // n * RECORD_ALIGN for i in range(n + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


class DirectReader:
    """ReadBackend for a vault and a ring: ``await read(record, slot)`` fills the slot.

    ``workers`` threads read concurrently (several in flight keep an NVMe queue busy;
    /work measured ~1.6x from 1 to 4 threads). Each takes its next read from a queue of its
    own, demand before speculation, as soon as it finishes one. A large record is read in
    ``parts`` (default: split_record's) at once, the worker's and helper threads'. Where the
    bytes land is the ring's business (``ring.landing``): in the slot itself, or in a
    landing buffer. ``direct``
    says whether reads bypass the page cache (see ``open_direct``; pass ``direct=False`` to
    ask for buffered reads). Close it (or use it as a context manager) to stop the threads
    and close the file.
    """

    def __init__(
        self,
        vault: Vault,
        ring: ExpertRing,
        workers: int = 4,
        direct: bool = True,
        parts: int | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        manifest = vault.manifest
        if ring.stride != manifest.record.stride:
            raise ValueError(
                f"the ring's slots are {ring.stride} bytes, the vault's records "
                f"{manifest.record.stride}: make the ring from this vault's record layout"
            )
        self.path = vault.experts_path
        self.manifest = manifest
        self.ring = ring
        self.stride = ring.stride
        self.workers = workers
        self.fd, self.direct = open_direct(self.path, direct)
        self._parts = split_record(self.stride, parts)
        self._helpers = concurrent.futures.ThreadPoolExecutor(
            max(1, workers * (len(self._parts) - 1)), thread_name_prefix="smoe-io-part"
        )
        # Our own threads rather than a ThreadPoolExecutor: a worker takes its next read
        # itself (priority order), a queued read can be taken back, close() can join them.
        self._queue = _ReadQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"smoe-io-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()
        self._closed = False
        self._close_lock = threading.Lock()

    async def read(self, record: int, slot: int, priority: int = 0) -> int:
        """Read record ``record`` into ring slot ``slot``; return the bytes read (the stride).

        ``priority``: 0 (demand) reads are taken before 1 (speculative) ones queued here.
        Raises VaultReadError (an OSError naming record, layer and expert) on an I/O error or
        a truncated file; IndexError for a record or slot out of range; RuntimeError after
        close(), or when close() drops the read while it is still queued.

        Cancellation: a read not yet started is dropped at once; a read in progress is
        waited for (cancelling again does not stop the wait), and only then is
        CancelledError raised, so no thread writes into the slot once this returns or raises.
        """
        if self._closed:
            raise RuntimeError("DirectReader is closed")
        if not 0 <= record < self.manifest.num_records:
            raise IndexError(f"record {record} out of range 0..{self.manifest.num_records - 1}")
        if not 0 <= slot < self.ring.num_slots:
            raise IndexError(f"slot {slot} out of range 0..{self.ring.num_slots - 1}")
        job = _Job(record, slot, concurrent.futures.Future())
        self._queue.put(job, priority)
        done = asyncio.wrap_future(job.future)
        try:
            # shield: cancelling us must not cancel `done`, or we would lose track of the thread.
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if job.future.cancelled() and not (task is not None and task.cancelling()):
                # close() dropped the queued job; this task itself was not cancelled.
                raise RuntimeError(f"DirectReader closed before record {record} was read") from None
            if self._queue.remove(job):  # never started: nothing writes into the slot
                job.future.cancel()
            else:  # already running: its thread may be writing into the slot
                await _wait_ignoring_cancel(done)
            raise

    def _work(self) -> None:
        """A worker thread: take reads until closed."""
        while (job := self._queue.take()) is not None:
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                n = self._read_into(job.record, job.slot)
            except BaseException as e:  # reported to read(); the worker carries on
                job.future.set_exception(e)
            else:
                job.future.set_result(n)

    def _read_into(self, record: int, slot: int) -> int:
        """Blocking: fill ``slot`` with ``record``'s stride bytes (runs on a worker thread).

        A record of several parts is read by the worker (the first part) and helper
        threads (the others) at once: a lone miss then keeps several requests in flight,
        as the disk needs for its full rate. Returns once every part has finished."""
        offset = record * self.stride
        with self.ring.landing(slot) as view:
            if len(self._parts) == 1:
                self._read_range(view, record, offset, 0, self.stride)
                return self.stride
            helpers = [
                self._helpers.submit(self._read_range, view, record, offset, start, end)
                for start, end in self._parts[1:]
            ]
            try:
                self._read_range(view, record, offset, *self._parts[0])
            finally:
                concurrent.futures.wait(helpers)  # no thread writes into the landing after
            for h in helpers:
                h.result()  # the first part's error wins; else a helper's
        return self.stride

    def _read_range(self, view: memoryview, record: int, offset: int, start: int, end: int) -> None:
        """Read bytes [start, end) of the record at file ``offset`` into ``view``."""
        done = start
        while done < end:
            try:
                n = os.preadv(self.fd, [view[done:end]], offset + done)
            except InterruptedError:  # PEP 475 retries EINTR itself; this covers a raised one
                continue
            except OSError as e:
                raise self._error(record, f"{e.strerror or e}", e.errno) from e
            if n == 0:  # EOF before the record's end
                raise self._error(record, f"vault file truncated at record {record}", None)
            done += n  # a short read: continue where it stopped

    def _error(self, record: int, what: str, cause_errno: int | None) -> VaultReadError:
        layer, expert = self.manifest.record_key(record)
        return VaultReadError(
            f"{self.path}: reading expert {expert} of layer {layer} (record {record}, "
            f"bytes {record * self.stride}..{(record + 1) * self.stride}) failed: {what}; "
            "run 'smoe inspect --verify' on the vault, or convert the model again",
            path=self.path,
            record=record,
            key=(layer, expert),
            cause_errno=cause_errno,
        )

    def close(self) -> None:
        """Wait for reads in progress, drop queued ones, stop the threads, close the file.

        Idempotent. A read() whose job was still queued raises RuntimeError. Blocking: call
        it when no reads are wanted any more (it waits for at most ``workers`` reads).
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        for job in self._queue.close():
            job.future.cancel()
        for t in self._threads:
            t.join()
        self._helpers.shutdown(wait=True)
        os.close(self.fd)

    def __enter__(self) -> DirectReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "direct" if self.direct else "buffered"
        return f"DirectReader({self.path}, {self.workers} workers, {mode})"


async def _wait_ignoring_cancel(fut: asyncio.Future[Any]) -> None:
    """Wait until ``fut`` is done, however often the waiting task is cancelled meanwhile."""
    while not fut.done():
        try:
            await asyncio.wait([fut])
        except asyncio.CancelledError:
            continue  # the caller re-raises the cancellation once the thread is done
    if not fut.cancelled() and fut.exception() is not None:  # retrieved: the cancellation wins
        log.debug("read finished with an error after its caller was cancelled: %s", fut.exception())


if TYPE_CHECKING:  # mypy checks that DirectReader is a ReadBackend

    def _is_read_backend(reader: DirectReader) -> ReadBackend:
        return reader
