"""The queue of reads handed to a RecordReader's worker threads (``smoe.io.reader``).

Two FIFO queues, demand taken before speculation; thread-safe. A job taken by a worker is
marked started under the queue's lock, so a reader that wants its queued read back
(``remove``) never takes one a worker is already running.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from dataclasses import dataclass


@dataclass(eq=False)
class ReadJob:
    """One read for the workers: ``record`` into ring slot ``slot``; ``future`` gets the
    bytes read or the error."""

    record: int
    slot: int
    future: concurrent.futures.Future[int]
    started: bool = False  # a worker took it (a re-read goes back to the queue started)
    rereads: int = 0  # reads after a checksum mismatch


class ReadQueue:
    """The reads handed to the workers: two FIFO queues, demand taken before speculation.

    Thread-safe. A worker takes its next read here the moment it finishes one, without a
    round trip through the event loop (which, measured, cost up to a third of the disk's
    rate at one worker with busy CPUs).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queues: tuple[collections.deque[ReadJob], ...] = (
            collections.deque(),
            collections.deque(),
        )
        self._closed = False

    def put(self, job: ReadJob, priority: int, *, first: bool = False) -> None:
        """Queue ``job`` (``first``: ahead of every other read, for a re-read someone
        is already waiting on). RuntimeError once closed."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the reader is closed")
            queue = self._queues[min(max(priority, 0), 1)]
            if first:
                queue.appendleft(job)
            else:
                queue.append(job)
            self._cond.notify()

    def take(self) -> ReadJob | None:
        """The next read (blocking), or None once closed."""
        with self._cond:
            while not self._closed:
                for q in self._queues:
                    if q:
                        job = q.popleft()
                        job.started = True  # under the lock: remove() sees it
                        return job
                self._cond.wait()
            return None

    def remove(self, job: ReadJob) -> bool:
        """Take ``job`` back if no worker has started it; True if it was still queued."""
        with self._cond:
            if job.started:  # a queued re-read: its reader waits for it to end
                return False
            for q in self._queues:
                if job in q:
                    q.remove(job)
                    return True
            return False

    def close(self) -> list[ReadJob]:
        """Stop handing out reads; return those still queued."""
        with self._cond:
            self._closed = True
            dropped = [job for q in self._queues for job in q]
            for q in self._queues:
                q.clear()
            self._cond.notify_all()
            return dropped
