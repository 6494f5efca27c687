"""The direct-I/O read backend: worker threads that preadv() whole records for ring slots.

One read = one record = one slot: ``os.preadv(fd, [ring.landing(slot)], record * stride)``.
The destination (the slot itself, or a host landing buffer of a staged ring) and the file
offset are 16 KiB-aligned and the length is the stride (a 16 KiB multiple), so O_DIRECT's
alignment rules hold and the page cache is bypassed: measured throughput is the SSD's.
Opening the file that way and splitting a record into parts is ``smoe.io.direct_file``;
the queue the workers take reads from is ``smoe.io.read_queue``.

Trust: a read completes only once its record's checksum (the manifest's, over the record's
``size`` bytes) matches, checked on a verifier thread while the worker reads on, and
before the bytes reach the slot (a staged ring commits nothing unchecked). A mismatch is
read again once; EINTR and EAGAIN are retried; every other failure is a VaultReadError
(a SmoeError) naming the file, record, layer, expert and the fix.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from smoe.errors import RecordChecksumError, VaultError
from smoe.errors import VaultReadError as VaultReadError  # re-exported: smoe.io's API
from smoe.io.direct_file import (
    FIX,
    READ_ATTEMPTS,
    TRANSIENT_ERRNOS,
    describe_os_error,
    open_vault_file,
    split_record,
)
from smoe.io.read_queue import ReadJob, ReadQueue
from smoe.io.ring import ExpertRing, Landing
from smoe.vault.format import Vault
from smoe.vault.integrity import hasher

if TYPE_CHECKING:
    from smoe.sched.types import ReadBackend

log = logging.getLogger(__name__)

# O_DIRECT continues a short read from a whole block: its offsets and lengths must be
# multiples of the device's logical block (512 B or 4 KiB).
_DIRECT_BLOCK = 4096


class DirectReader:
    """ReadBackend for a vault and a ring: ``await read(record, slot)`` fills the slot.

    ``workers`` threads read concurrently (several in flight keep an NVMe queue busy;
    /work measured ~1.6x from 1 to 4 threads). Each takes its next read from a queue of its
    own, demand before speculation, as soon as it finishes one. A large record is read in
    ``parts`` (default: split_record's) at once, the worker's and helper threads'. Where the
    bytes land is the ring's business (``ring.land``): in the slot itself, or in a landing
    buffer. ``direct`` says whether reads bypass the page cache (see ``open_direct``; pass
    ``direct=False`` to ask for buffered reads). Close it (or use it as a context manager)
    to stop the threads and close the file.

    ``verify`` (the default; the engine always verifies): a read completes only once the
    record's bytes match the manifest's checksum. Hashing runs on verifier threads, so a
    worker starts its next read meanwhile; a staged ring's landing is handed over (to be
    committed) only once it matches. A mismatch is read again once (a transient bus or DMA
    error), then fails with RecordChecksumError. ``verify=False`` exists for benchmarks.
    """

    def __init__(
        self,
        vault: Vault,
        ring: ExpertRing,
        workers: int = 4,
        direct: bool = True,
        parts: int | None = None,
        verify: bool = True,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        manifest = vault.manifest
        if ring.stride != manifest.record.stride:
            raise ValueError(
                f"the ring's slots are {ring.stride} bytes, the vault's records "
                f"{manifest.record.stride}: make the ring from this vault's record layout"
            )
        self._hash = _checksum_function(vault)
        self.vault_path = vault.path
        self.path = vault.experts_path
        self.manifest = manifest
        self.ring = ring
        self.stride = ring.stride
        self.size = manifest.record.size
        self.workers = workers
        self.verify = verify
        self.rereads = 0  # records read again after a checksum mismatch
        self._count_lock = threading.Lock()
        self.fd, self.direct = open_vault_file(self.path, direct)
        self._parts = split_record(self.stride, parts)
        self._start_threads(workers)
        self._closed = False
        self._close_lock = threading.Lock()

    def _start_threads(self, workers: int) -> None:
        """The part helpers, the verifiers, the read queue and the ``workers`` workers."""
        self._helpers = concurrent.futures.ThreadPoolExecutor(
            max(1, workers * (len(self._parts) - 1)), thread_name_prefix="smoe-io-part"
        )
        # Hashing happens here, not on the workers: a worker starts its next read while
        # its last record is checked (xxh3: ~5% of a read's time; crc32 ~65%, measured).
        self._verifier = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix="smoe-io-verify"
        )
        # Our own threads rather than a ThreadPoolExecutor: a worker takes its next read
        # itself (priority order), a queued read can be taken back, close() can join them.
        self._queue = ReadQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"smoe-io-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    async def read(self, record: int, slot: int, priority: int = 0) -> int:
        """Read record ``record`` into ring slot ``slot``; return the bytes read (the stride)
        once they are in the slot (landed, and verified unless ``verify`` is off).

        ``priority``: 0 (demand) reads are taken before 1 (speculative) ones queued here.
        Raises VaultReadError (a SmoeError naming the file, record, layer, expert and the
        fix; ``errno`` kept as an attribute) on an I/O error that retries did not cure or a
        truncated file, RecordChecksumError (a VaultReadError) when the bytes mismatch their
        checksum twice; IndexError for a record or slot out of range; RuntimeError after
        close(), or when close() drops the read while it is still queued.

        Cancellation: a read not yet started is dropped at once; a read in progress (also
        one being verified or read again) is waited for (cancelling again does not stop the
        wait), and only then is CancelledError raised, so no thread writes into the slot
        once this returns or raises.
        """
        if self._closed:
            raise RuntimeError("DirectReader is closed")
        if not 0 <= record < self.manifest.num_records:
            raise IndexError(f"record {record} out of range 0..{self.manifest.num_records - 1}")
        if not 0 <= slot < self.ring.num_slots:
            raise IndexError(f"slot {slot} out of range 0..{self.ring.num_slots - 1}")
        job = ReadJob(record, slot, concurrent.futures.Future())
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
            if job.rereads == 0 and not job.future.set_running_or_notify_cancel():
                continue
            try:
                land, data = self._read_into(job.record, job.slot)
            except BaseException as e:  # reported to read(); the worker carries on
                job.future.set_exception(e)
                continue
            if not self.verify:
                land.hand_over()
                job.future.set_result(self.stride)
                continue
            try:  # pipelined: this worker takes its next read while the record is hashed
                self._verifier.submit(self._check, job, land, data)
            except BaseException as e:  # (the verifier outlives the workers: defensive)
                land.discard()
                job.future.set_exception(e)

    def _read_into(self, record: int, slot: int) -> tuple[Landing, memoryview]:
        """Blocking: read ``record``'s stride bytes for ``slot`` (runs on a worker thread).
        Returns the landing, not handed over yet, and the bytes as the slot will get them.

        A record of several parts is read by the worker (the first part) and helper
        threads (the others) at once: a lone miss then keeps several requests in flight,
        as the disk needs for its full rate. Returns once every part has finished; on an
        error the landing has been discarded."""
        offset = record * self.stride
        land = self.ring.land(slot)
        try:
            view = land.memory
            if len(self._parts) == 1:
                self._read_range(view, record, offset, 0, self.stride)
            else:
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
            return land, land.finish()
        except BaseException:
            land.discard()
            raise

    def _check(self, job: ReadJob, land: Landing, data: memoryview) -> None:
        """Verifier thread: hand the landing over if its bytes match the record's checksum;
        else discard them and read the record again once, then fail. Never blocks (a
        re-read goes back to the workers' queue, first), so verification cannot deadlock
        with the landing pool."""
        record = job.record
        try:
            expected = self.manifest.checksums[record]
            actual = self._hash(data[: self.size])
            if actual == expected:
                land.hand_over()
                job.future.set_result(self.stride)
                if job.rereads:  # cured, but the disk or the bus is worth a look
                    log.warning(
                        "%s: record %d matched its checksum only when read again (a "
                        "transient read error); check the disk (dmesg)",
                        self.path,
                        record,
                    )
                return
            land.discard()
            if job.rereads == 0:  # silent: a second mismatch is the error to report
                job.rereads += 1
                with self._count_lock:  # (verifier threads count concurrently)
                    self.rereads += 1
                self._queue.put(job, 0, first=True)  # someone waits for it: demand, first
                return
            layer, expert = self.manifest.record_key(record)
            raise RecordChecksumError(
                f"{self.path}: expert {expert} of layer {layer} (record {record}, bytes "
                f"{record * self.stride}..{record * self.stride + self.size}) does not match "
                f"its {self.manifest.checksum_algorithm} checksum, read twice "
                f"({actual:x}, expected {expected:x}): the vault file is corrupt there; "
                + FIX.format(vault=self.vault_path),
                path=self.path,
                record=record,
                key=(layer, expert),
                algorithm=self.manifest.checksum_algorithm,
                expected=expected,
                actual=actual,
            )
        except BaseException as e:  # reported to read(); nothing reaches the slot
            land.discard()
            if isinstance(e, RuntimeError) and self._closed:
                e = RuntimeError(f"DirectReader closed before record {record} was read")
            job.future.set_exception(e)

    def _read_range(self, view: memoryview, record: int, offset: int, start: int, end: int) -> None:
        """Read bytes [start, end) of the record at file ``offset`` into ``view``.

        A short read continues where it stopped (with O_DIRECT, from the last whole 4 KiB,
        which it needs aligned); EINTR and EAGAIN are tried again, up to READ_ATTEMPTS
        times in a row without progress; anything else raises VaultReadError."""
        done = start
        stalled = 0  # attempts in a row that moved nothing
        while done < end:
            try:
                n = os.preadv(self.fd, [view[done:end]], offset + done)
            except OSError as e:
                stalled += 1
                if e.errno in TRANSIENT_ERRNOS and stalled < READ_ATTEMPTS:
                    continue
                raise self._error(record, describe_os_error(e), e.errno) from e
            if n == 0:  # EOF before the record's end
                raise self._error(
                    record, f"the file ends inside it (at byte {offset + done}): truncated", None
                )
            moved = n - n % _DIRECT_BLOCK if self.direct else n
            if moved:
                done += moved
                stalled = 0
                continue
            stalled += 1  # a direct read shorter than a block: read that block again
            if stalled >= READ_ATTEMPTS:
                raise self._error(record, f"short reads of {n} bytes at {offset + done}", None)

    def _error(self, record: int, what: str, cause_errno: int | None) -> VaultReadError:
        layer, expert = self.manifest.record_key(record)
        return VaultReadError(
            f"{self.path}: reading expert {expert} of layer {layer} (record {record}, bytes "
            f"{record * self.stride}..{(record + 1) * self.stride}) failed: {what}; "
            + FIX.format(vault=self.vault_path),
            path=self.path,
            record=record,
            key=(layer, expert),
            errno=cause_errno,
        )

    def close(self) -> None:
        """Wait for reads in progress (and their verification), drop queued ones, stop the
        threads, close the file.

        Idempotent. A read() whose job was still queued raises RuntimeError. Blocking: call
        it when no reads are wanted any more (it waits for at most ``workers`` reads).
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        for job in self._queue.close():
            if not job.future.cancel():  # a re-read: its future is running already
                job.future.set_exception(
                    RuntimeError(f"DirectReader closed before record {job.record} was read")
                )
        for t in self._threads:
            t.join()
        self._verifier.shutdown(wait=True)  # a re-read it queues now fails: queue closed
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


def _checksum_function(vault: Vault) -> Callable[[Any], int]:
    """The hash of the vault's checksum algorithm; VaultError if it is unknown."""
    manifest = vault.manifest
    try:
        return hasher(manifest.checksum_algorithm)
    except KeyError:
        raise VaultError(
            f"{vault.path}: checksum algorithm {manifest.checksum_algorithm!r} is unknown "
            "to this S-MoE; upgrade S-MoE or convert the model again"
        ) from None


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
