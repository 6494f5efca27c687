"""The vault file for direct I/O: opening it so that reads bypass the page cache, the retry
rules of one read, and how a record is split into parts read at once.

``open_direct`` prefers O_DIRECT (Linux; probed with one aligned read, since some
filesystems accept the flag and refuse the reads), then F_NOCACHE (macOS), then buffered
reads with a BufferedIOWarning. ``split_record`` keeps every part a multiple of 16 KiB, as
O_DIRECT needs. The reads themselves are ``smoe.io.direct``'s (DirectReader).
"""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path

import numpy as np

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

from smoe.errors import VaultReadError
from smoe.vault.layout import RECORD_ALIGN


class BufferedIOWarning(RuntimeWarning):
    """The vault is read through the page cache: direct I/O was refused or unavailable."""


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
    for attempt in range(1, READ_ATTEMPTS + 1):
        try:
            os.preadv(fd, [raw[start : start + RECORD_ALIGN].data], 0)
            return
        except OSError as e:
            if e.errno not in TRANSIENT_ERRNOS or attempt == READ_ATTEMPTS:
                raise


TRANSIENT_ERRNOS = frozenset({errno.EINTR, errno.EAGAIN, errno.EWOULDBLOCK})
# Tries of one read request that fail with a transient error before the read fails. No
# sleep between them: EINTR means a signal, not a busy device. Short reads do not count:
# they made progress, and the read continues where it stopped.
READ_ATTEMPTS = 3
FIX = "check the disk (dmesg); 'smoe inspect {vault} --verify' finds corrupt records; convert again"


def describe_os_error(e: OSError) -> str:
    """'Input/output error (EIO)': the OS's words and the errno's name."""
    name = errno.errorcode.get(e.errno, str(e.errno)) if e.errno is not None else None
    text = e.strerror or str(e) or type(e).__name__
    return f"{text} ({name})" if name else text


def open_direct(path: Path | str, direct: bool = True) -> tuple[int, bool]:
    """Open ``path`` read-only for uncached reads; return (fd, whether reads bypass the cache).

    Linux: O_DIRECT, checked with one aligned 16 KiB read, since some filesystems accept the
    flag at open and refuse the reads (EINVAL). macOS: F_NOCACHE. Where neither works, or with
    ``direct=False`` (no warning then), the file is opened buffered; a BufferedIOWarning
    names the file and the consequence. Raises OSError (FileNotFoundError, ...) when the
    file cannot be opened at all, and VaultReadError (naming the file and the errno) when
    the probe read fails otherwise than by refusing O_DIRECT (EIO: a failing disk). The
    caller closes the fd.
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
                raise VaultReadError(
                    f"{path}: reading its first {RECORD_ALIGN // 1024} KiB failed: "
                    f"{describe_os_error(e)}; " + FIX.format(vault=path.parent),
                    path=path,
                    errno=e.errno,
                ) from e
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


def open_vault_file(path: Path, direct: bool) -> tuple[int, bool]:
    """``open_direct(path, direct)``, with a file that cannot be opened at all reported as a
    VaultReadError (naming the file, the errno and the fix) instead of a bare OSError."""
    try:
        return open_direct(path, direct)
    except VaultReadError:
        raise
    except OSError as e:
        raise VaultReadError(
            f"{path}: cannot open it for reading: {describe_os_error(e)}; check that "
            "the vault is complete and readable ('smoe inspect'), or convert again",
            path=path,
            errno=e.errno,
        ) from e
