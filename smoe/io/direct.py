"""The vault's read backend: ``DirectReader``, a RecordReader (``smoe.io.reader``) over one
vault file, each record read whole with preadv() into its slot, and verified.

One read = one record = one slot: ``os.preadv(fd, [ring.landing(slot)], record * stride)``.
The destination (the slot itself, or a host landing buffer of a staged ring) and the file
offset are 16 KiB-aligned and the length is the stride (a 16 KiB multiple), so O_DIRECT's
alignment rules hold and the page cache is bypassed: measured throughput is the SSD's.
Opening the file that way and splitting a record into parts is ``smoe.io.direct_file``.

Trust: a read completes only once its record's checksum (the manifest's, over the record's
``size`` bytes) matches, checked on a verifier thread while the worker reads on, and
before the bytes reach the slot (a staged ring commits nothing unchecked). A mismatch is
read again once; EINTR and EAGAIN are retried; every other failure is a VaultReadError
(a SmoeError) naming the file, record, layer, expert and the fix.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Callable
from typing import Any

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
from smoe.io.reader import RecordReader, check_reader_args
from smoe.io.ring import ExpertRing
from smoe.vault.format import Vault
from smoe.vault.integrity import hasher

log = logging.getLogger(__name__)

# O_DIRECT continues a short read from a whole block: its offsets and lengths must be
# multiples of the device's logical block (512 B or 4 KiB).
_DIRECT_BLOCK = 4096


class VaultFile:
    """RecordLocations of a vault: record r is bytes [r * stride, (r + 1) * stride) of its
    experts file. A large record is read in ``parts`` (default: split_record's) at once."""

    def __init__(self, vault: Vault, direct: bool = True, parts: int | None = None) -> None:
        m = vault.manifest
        self.vault_path = vault.path
        self.path = vault.experts_path
        self.manifest = m
        self.num_records = m.num_records
        self.stride = m.record.stride
        self.fd, self.direct = open_vault_file(self.path, direct)
        self.parts = split_record(self.stride, parts)  # [start, end) of each part
        self.helpers_per_worker = len(self.parts) - 1

    def fill(
        self, view: memoryview, record: int, helpers: concurrent.futures.ThreadPoolExecutor
    ) -> None:
        """The record's stride bytes into ``view``: the first part on this thread, the
        others on ``helpers`` at once (a lone miss keeps several requests in flight, as the
        disk needs for its full rate); returns once every part has finished."""
        offset = record * self.stride
        if len(self.parts) == 1:
            self._read_range(view, record, offset, 0, self.stride)
            return
        rest = [
            helpers.submit(self._read_range, view, record, offset, start, end)
            for start, end in self.parts[1:]
        ]
        try:
            self._read_range(view, record, offset, *self.parts[0])
        finally:
            concurrent.futures.wait(rest)  # no thread writes into the landing after
        for h in rest:
            h.result()  # the first part's error wins; else a helper's

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
        os.close(self.fd)

    def describe(self) -> str:
        return f"{self.path}, {'direct' if self.direct else 'buffered'}"


class VaultChecksums:
    """RecordChecks of a vault: the manifest's checksum of each record's ``size`` bytes."""

    def __init__(self, vault: Vault) -> None:
        self.vault_path = vault.path
        self.path = vault.experts_path
        self.manifest = vault.manifest
        self.size = vault.manifest.record.size
        self.stride = vault.manifest.record.stride
        self.hash = _checksum_function(vault)

    def matches(self, record: int, data: memoryview) -> tuple[bool, int]:
        actual = self.hash(data[: self.size])
        return actual == self.manifest.checksums[record], actual

    def mismatch(self, record: int, actual: int) -> Exception:
        layer, expert = self.manifest.record_key(record)
        expected = self.manifest.checksums[record]
        return RecordChecksumError(
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

    def cured(self, record: int) -> None:  # cured, but the disk or the bus is worth a look
        log.warning(
            "%s: record %d matched its checksum only when read again (a transient read "
            "error); check the disk (dmesg)",
            self.path,
            record,
        )


class DirectReader(RecordReader):
    """ReadBackend for a vault and a ring: ``await read(record, slot)`` fills the slot
    (``RecordReader.read``: its errors and cancellation).

    ``workers`` threads read concurrently (several in flight keep an NVMe queue busy;
    measured ~1.6x from 1 to 4 threads). A large record is read in ``parts`` at once.
    Where the bytes land is the ring's business (``ring.land``): in the slot itself, or in
    a landing buffer. ``direct`` says whether reads bypass the page cache (see
    ``open_direct``; pass ``direct=False`` to ask for buffered reads).

    ``verify`` (the default; the engine always verifies): a read completes only once the
    record's bytes match the manifest's checksum; a mismatch is read again once, then fails
    with RecordChecksumError. ``verify=False`` exists for benchmarks.
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
        check_reader_args(workers, ring, vault.manifest.record.stride)  # before opening
        checks = VaultChecksums(vault) if verify else None  # an unknown algorithm: VaultError
        self.file = VaultFile(vault, direct, parts)
        try:
            super().__init__(self.file, ring, workers, checks)
        except BaseException:
            self.file.close()
            raise


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
