"""The one read backend: worker threads that fill ring slots with records, wherever the
records' bytes lie.

``RecordReader`` owns what every reader shares: the worker threads and the helper threads
that read a record's parts at once, the queue they take reads from (demand before
speculation, ``smoe.io.read_queue``), the optional verification pipeline, ``close``, and
the ``read()`` cancellation protocol. Where a record's bytes are is a ``RecordLocations``:
one vault file at ``record * stride`` (``smoe.io.direct.VaultFile``), or extents across a
download's shards through bounce buffers (``smoe.io.shard_reader.ShardExtents``).

Rules: a slot is written only between a read's start and the completion of its future; a
read that is cancelled while a thread writes its slot is waited for, so no thread writes
into a slot after ``read()`` returns or raises. A staged ring's landing is handed over
(committed) only after its bytes are verified, where there is something to verify against.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from smoe.io.read_queue import ReadJob, ReadQueue
from smoe.io.ring import ExpertRing, Landing

if TYPE_CHECKING:
    from smoe.sched.types import ReadBackend

log = logging.getLogger(__name__)


class RecordLocations(Protocol):
    """Where records' bytes lie, and how to read one into a slot's landing."""

    num_records: int
    stride: int  # bytes of a record as a slot holds it
    direct: bool  # whether reads bypass the page cache
    helpers_per_worker: int  # threads each worker needs to read a record's parts at once

    def fill(
        self, view: memoryview, record: int, helpers: concurrent.futures.ThreadPoolExecutor
    ) -> None:
        """Blocking: every byte of ``record`` into ``view``, parts read on ``helpers`` at
        once; returns once no thread writes into ``view`` any more. Raises VaultReadError
        (naming the file, the layer, the expert and the fix) for what retries did not cure."""

    def close(self) -> None:
        """Close the files (after every read has finished)."""

    def describe(self) -> str:
        """For repr: the file or folder and the mode."""


class RecordChecks(Protocol):
    """What a read is verified against: the bytes a record must hash to."""

    def matches(self, record: int, data: memoryview) -> tuple[bool, int]:
        """Whether ``data`` (the record as the slot gets it) hashes as recorded; the hash."""

    def mismatch(self, record: int, actual: int) -> Exception:
        """The error for a record that mismatched twice (RecordChecksumError)."""

    def cured(self, record: int) -> None:
        """Told when a record matched only when read again (worth a warning)."""


def check_reader_args(workers: int, ring: ExpertRing, stride: int) -> None:
    """ValueError for a reader of no workers, or a ring whose slots do not fit the model's
    records (``stride``). Readers call it before they open files."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if ring.stride != stride:
        raise ValueError(
            f"the ring's slots are {ring.stride} bytes, the model's records {stride}: make "
            "the ring from this model's record layout"
        )


class RecordReader:
    """ReadBackend for a ring: ``await read(record, slot)`` fills the slot from
    ``locations``. ``workers`` threads read concurrently (several in flight keep an NVMe
    queue busy), each taking its next read from the queue as soon as it finishes one.
    Close it (or use it as a context manager) to stop the threads and close the files.

    ``checks`` (None: nothing to verify): a read completes only once its bytes match.
    Hashing runs on verifier threads, so a worker starts its next read meanwhile; a
    mismatch is read again once (a transient bus or DMA error), then fails.
    """

    def __init__(
        self,
        locations: RecordLocations,
        ring: ExpertRing,
        workers: int = 4,
        checks: RecordChecks | None = None,
    ) -> None:
        check_reader_args(workers, ring, locations.stride)
        self.locations = locations
        self.ring = ring
        self.stride = ring.stride
        self.workers = workers
        self.checks = checks
        self.direct = locations.direct
        self.rereads = 0  # records read again after a checksum mismatch
        self._count_lock = threading.Lock()
        self._closed = False
        self._close_lock = threading.Lock()
        self._start_threads(workers)

    @property
    def verify(self) -> bool:
        return self.checks is not None

    def _start_threads(self, workers: int) -> None:
        """The part helpers, the verifiers, the read queue and the ``workers`` workers."""
        self._helpers = concurrent.futures.ThreadPoolExecutor(
            max(1, workers * self.locations.helpers_per_worker), thread_name_prefix="smoe-io-part"
        )
        # Hashing happens there, not on the workers: a worker starts its next read while
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

    def _closed_error(self, record: int) -> RuntimeError:
        return RuntimeError(f"{type(self).__name__} closed before record {record} was read")

    async def read(self, record: int, slot: int, priority: int = 0) -> int:
        """Read record ``record`` into ring slot ``slot``; return the bytes read (the stride)
        once they are in the slot (landed, and verified where there are checks).

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
            raise RuntimeError(f"{type(self).__name__} is closed")
        if not 0 <= record < self.locations.num_records:
            raise IndexError(f"record {record} out of range 0..{self.locations.num_records - 1}")
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
                raise self._closed_error(record) from None  # close() dropped the queued job
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
            if self.checks is None:
                land.hand_over()
                job.future.set_result(self.stride)
                continue
            try:  # pipelined: this worker takes its next read while the record is hashed
                self._verifier.submit(self._check, job, land, data)
            except BaseException as e:  # (the verifier outlives the workers: defensive)
                land.discard()
                job.future.set_exception(e)

    def _read_into(self, record: int, slot: int) -> tuple[Landing, memoryview]:
        """Blocking: read ``record`` for ``slot`` (runs on a worker thread). Returns the
        landing, not handed over yet, and the bytes as the slot will get them; on an error
        the landing has been discarded. (Tests wrap it to force orderings.)"""
        land = self.ring.land(slot)  # RuntimeError once the ring is closed
        try:
            self.locations.fill(land.memory, record, self._helpers)
            return land, land.finish()
        except BaseException:
            land.discard()
            raise

    def _check(self, job: ReadJob, land: Landing, data: memoryview) -> None:
        """Verifier thread: hand the landing over if its bytes match the record's checksum;
        else discard them and read the record again once, then fail. Never blocks (a
        re-read goes back to the workers' queue, first), so verification cannot deadlock
        with the landing pool."""
        assert self.checks is not None
        record = job.record
        try:
            ok, actual = self.checks.matches(record, data)
            if ok:
                land.hand_over()
                job.future.set_result(self.stride)
                if job.rereads:
                    self.checks.cured(record)
                return
            land.discard()
            if job.rereads == 0:  # silent: a second mismatch is the error to report
                job.rereads += 1
                with self._count_lock:  # (verifier threads count concurrently)
                    self.rereads += 1
                self._queue.put(job, 0, first=True)  # someone waits for it: demand, first
                return
            raise self.checks.mismatch(record, actual)
        except BaseException as e:  # reported to read(); nothing reaches the slot
            land.discard()
            if isinstance(e, RuntimeError) and self._closed:
                e = self._closed_error(record)
            job.future.set_exception(e)

    def close(self) -> None:
        """Wait for reads in progress (and their verification), drop queued ones, stop the
        threads, close the files.

        Idempotent. A read() whose job was still queued raises RuntimeError. Blocking: call
        it when no reads are wanted any more (it waits for at most ``workers`` reads).
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        for job in self._queue.close():
            if not job.future.cancel():  # a re-read: its future is running already
                job.future.set_exception(self._closed_error(job.record))
        for t in self._threads:
            t.join()
        self._verifier.shutdown(wait=True)  # a re-read it queues now fails: queue closed
        self._helpers.shutdown(wait=True)
        self.locations.close()

    def __enter__(self) -> RecordReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.locations.describe()}, {self.workers} workers)"


async def _wait_ignoring_cancel(fut: asyncio.Future[Any]) -> None:
    """Wait until ``fut`` is done, however often the waiting task is cancelled meanwhile."""
    while not fut.done():
        try:
            await asyncio.wait([fut])
        except asyncio.CancelledError:
            continue  # the caller re-raises the cancellation once the thread is done
    if not fut.cancelled() and fut.exception() is not None:  # retrieved: the cancellation wins
        log.debug("read finished with an error after its caller was cancelled: %s", fut.exception())


if TYPE_CHECKING:  # mypy checks that RecordReader is a ReadBackend

    def _is_read_backend(reader: RecordReader) -> ReadBackend:
        return reader
