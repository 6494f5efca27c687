"""Crash-safe file system helpers: write to a temporary name, fsync, rename.

Every writer in S-MoE that replaces a file or a directory goes through ``atomic_path`` /
``atomic_write`` (files) or ``replace_dir`` (directories), so a reader, or the next start
after a kill, finds the old complete state or the new one, never a mix.

Temporary names (one scheme, so that a later start can tell what a dead process left):

    .NAME.KIND-PID[.EXT]    beside the target NAME, written by process PID
      KIND  tmp         a file (or a synth checkpoint) being written
            converting  a vault being built by `smoe convert`, or a shard by `smoe shard`
            exporting   an mlx-lm folder being built by `smoe export`
            old         a directory moved aside while its replacement goes in (only where
                        the atomic exchange is unavailable)
      .EXT  kept last by writers whose library insists on the extension (.npz, .safetensors)

``sweep_stale`` removes those whose PID no longer runs; ``recover_dir`` completes or undoes a
directory swap that a kill interrupted (``tidy_target`` runs both before a folder is written).
``open_regular`` opens a file to read only if it is one (not a FIFO, which would block). PIDs are those of this host: a file system shared
by several hosts (or PID namespaces) may see another host's live writer as dead.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import re
import shutil
import signal
import stat
import sys
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO

from smoe.errors import SmoeError

KINDS = ("tmp", "converting", "exporting", "old")
_TEMP_RE = re.compile(
    r"^\.(?P<name>.+)\.(?P<kind>tmp|converting|exporting|old)-(?P<pid>[0-9]+)"
    r"(?P<ext>\.[A-Za-z0-9]+)?$"
)

# Test hook (tests/system/test_crash_safety.py): SMOE_TEST_KILL_AT=POINT or POINT:NAME makes the
# process SIGKILL itself when it reaches kill_point(POINT, NAME). Unset in normal use.
KILL_ENV = "SMOE_TEST_KILL_AT"

# errno values meaning "this system or file system cannot exchange": use two renames.
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP}


def kill_point(point: str, name: str = "") -> None:
    """Test hook: die by SIGKILL here if $SMOE_TEST_KILL_AT is ``point`` or ``point:name``."""
    if os.environ.get(KILL_ENV) in (point, f"{point}:{name}"):
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (so that renames inside it are durable). Raises OSError."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # fsync names no file: the message should (EIO on what?)
        raise OSError(e.errno, e.strerror, str(path)) from e
    finally:
        os.close(fd)


class NotRegularFile(OSError):
    """A path that should be a file is a FIFO, a device, a socket or a directory."""

    def __init__(self, path: Path | str, mode: int) -> None:
        self.kind = file_kind(mode)
        super().__init__(errno.EINVAL, f"is {self.kind}, not a regular file", str(path))

    def __str__(self) -> str:
        return f"{self.filename} {self.strerror}"


def file_kind(mode: int) -> str:
    """What ``mode`` (a stat's st_mode) says the entry is, for a message: "a FIFO", ..."""
    for test, kind in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return kind
    return "not a file"


def open_regular(path: Path | str) -> BinaryIO:
    """``path`` opened for reading (binary, buffered) if it is a regular file (a link to one
    is followed). Anything else is refused before a byte is read: a FIFO blocks open() and
    read() until a writer comes, maybe never, and a device may never end. The open cannot
    block (O_NONBLOCK, cleared once the file is known to be regular). Raises
    NotRegularFile, or OSError as open() does (FileNotFoundError, PermissionError, ...)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(path, mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def temp_path(target: Path, kind: str = "tmp", keep_suffix: bool = False) -> Path:
    """This process's temporary name for ``target``: `.NAME.KIND-PID`, or with ``keep_suffix``
    `.STEM.KIND-PID.SUFFIX` (for writers that append their extension when it is missing)."""
    assert kind in KINDS, kind
    if keep_suffix and target.suffix:
        return target.with_name(f".{target.stem}.{kind}-{os.getpid()}{target.suffix}")
    return target.with_name(f".{target.name}.{kind}-{os.getpid()}")


@dataclass(frozen=True)
class TempName:
    """A parsed temporary name: the target it stands for, its kind and its writer's PID."""

    target: str
    kind: str
    pid: int


def parse_temp(name: str) -> TempName | None:
    """``name`` as one of our temporaries, or None if it does not follow the scheme."""
    m = _TEMP_RE.match(name)
    if m is None:
        return None
    return TempName(m["name"] + (m["ext"] or ""), m["kind"], int(m["pid"]))


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` may still run. Anything unsure (no permission to signal it,
    an impossible PID) counts as alive, so that its files are never touched."""
    if pid <= 0 or sys.platform == "win32":  # 0: a process group; Windows: kill terminates
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True
    return True


def _dead(t: TempName) -> bool:
    return t.pid != os.getpid() and not pid_alive(t.pid)


def sweep_stale(
    directory: Path, targets: Collection[str] | None = None, suffix: str | None = None
) -> list[Path]:
    """Remove the temporaries (`.NAME.KIND-PID[.EXT]`) in ``directory`` of processes that no
    longer run; returns what was removed.

    Only names following the scheme are looked at, and of those only the ones for a NAME in
    ``targets`` / ending with ``suffix`` when given. A live PID's are kept (this process's
    too). An `old` tree is kept while NAME is missing: it may be the only copy, which
    ``recover_dir`` puts back. Never raises: a missing or unreadable directory sweeps nothing,
    and what cannot be deleted stays.
    """
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        t = parse_temp(name)
        if t is None or (targets is not None and t.target not in targets):
            continue
        if suffix is not None and not t.target.endswith(suffix):
            continue
        if not _dead(t):
            continue
        if t.kind == "old" and not os.path.lexists(directory / t.target):
            continue
        remove_tree(directory / name)
        removed.append(directory / name)
    return removed


def recover_dir(dst: Path, complete: Callable[[Path], bool] | None = None) -> bool:
    """Repair a directory swap that a dead process left half done: ``dst`` missing, and its
    old tree aside as `.NAME.old-PID` (the two-rename fallback of ``replace_dir``).

    If that process's new tree (`.NAME.KIND-PID`, same PID) passes ``complete``, it goes in
    (the swap finishes); otherwise the old tree goes back. Returns whether ``dst`` was
    restored. Does nothing while ``dst`` exists or the PID runs; deletes nothing (call
    ``sweep_stale`` after it). Raises OSError if a rename fails (both trees then stay).
    """
    if os.path.lexists(dst):
        return False
    try:
        names = os.listdir(dst.parent)
    except OSError:
        return False
    olds: list[tuple[Path, int]] = []
    news: dict[int, Path] = {}
    for name in names:
        t = parse_temp(name)
        if t is None or t.target != dst.name or not _dead(t):
            continue
        if t.kind == "old":
            olds.append((dst.parent / name, t.pid))
        else:
            news[t.pid] = dst.parent / name
    if not olds:
        return False
    # Several (rare: repeated kills): the one moved aside last is the latest vault.
    old, pid = max(olds, key=lambda o: o[0].lstat().st_ctime)
    new = news.get(pid)
    src = new if new is not None and complete is not None and complete(new) else old
    os.rename(src, dst)
    fsync_path(dst.parent)
    return True


def tidy_target(dst: Path, complete: Callable[[Path], bool], what: str) -> None:
    """Before writing the folder ``dst`` (a vault, a shard, an export), repair and remove
    what killed runs left beside it: a --force swap interrupted between its two renames is
    finished or undone (``recover_dir``, ``complete`` telling a finished new tree), then
    their `.NAME.KIND-PID` trees are deleted (``sweep_stale``), which would otherwise
    stay, each as large as the output. SmoeError if the old ``what`` cannot be put back."""
    try:
        recover_dir(dst, complete=complete)
    except OSError as e:
        raise SmoeError(
            f"{dst} is missing and the {what} a killed run moved aside beside it cannot be "
            f"put back ({e}); rename the .{dst.name}.old-* directory to {dst.name}"
        ) from None
    sweep_stale(dst.parent, targets=[dst.name])


def make_temp_dir(dst: Path, kind: str) -> Path:
    """This process's empty temporary folder for ``dst`` (`.NAME.KIND-PID`), its parent
    made first. Raises OSError (NotADirectoryError where a file stands for the parent)."""
    parent = dst.parent
    if parent.exists() and not parent.is_dir():  # mkdir would say "File exists"
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(parent))
    parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(dst, kind)
    remove_tree(tmp)  # a dead run's that had our PID
    tmp.mkdir()
    return tmp


@functools.cache
def _exchange_fn() -> Callable[[bytes, bytes], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if sys.platform == "darwin":
            swap = libc.renamex_np  # RENAME_SWAP = 2 (macOS 10.12+)
            swap.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint]
            return lambda a, b: int(swap(a, b, 2))
        fn = libc.renameat2  # RENAME_EXCHANGE = 2 (Linux 3.15+, glibc 2.28+)
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        at_fdcwd = -100
        return lambda a, b: int(fn(at_fdcwd, a, at_fdcwd, b, 2))
    except (OSError, AttributeError):
        return None


def exchange(a: Path, b: Path) -> None:
    """Swap the entries ``a`` and ``b`` in one atomic step (both must exist). Raises OSError;
    its errno is ENOSYS / EINVAL / ENOTSUP where the system or file system cannot."""
    fn = _exchange_fn()
    if fn is None:
        raise OSError(errno.ENOSYS, "atomic exchange is not available here")
    if fn(os.fsencode(a), os.fsencode(b)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(a), None, str(b))


def replace_dir(tmp: Path, dst: Path) -> None:
    """Move the finished directory ``tmp`` to ``dst``, replacing what is there.

    Where it can (Linux, macOS), one atomic exchange swaps them, so ``dst`` is at every
    instant the old complete tree or the new one; the old tree, now at ``tmp``, is then
    deleted (a kill first leaves it to ``sweep_stale``). Elsewhere the old tree is renamed
    aside to `.NAME.old-PID` first: a kill between the two renames leaves ``dst`` missing,
    which ``recover_dir`` repairs at the next start. Raises OSError if a rename fails; the
    old ``dst`` is then in place and ``tmp`` remains for the caller to remove.
    """
    if not os.path.lexists(dst):
        os.rename(tmp, dst)
        fsync_path(dst.parent)
        return
    try:
        exchange(tmp, dst)
    except OSError as e:
        if e.errno not in _NO_EXCHANGE:
            raise
    else:
        fsync_path(dst.parent)
        kill_point("replace_dir.exchanged", dst.name)
        remove_tree(tmp)
        return
    old = temp_path(dst, "old")
    remove_tree(old)  # a dead process's that had our PID
    os.rename(dst, old)
    kill_point("replace_dir.aside", dst.name)
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(old, dst)
        raise
    fsync_path(dst.parent)
    kill_point("replace_dir.swapped", dst.name)
    remove_tree(old)


@contextlib.contextmanager
def atomic_path(path: Path, keep_suffix: bool = False) -> Iterator[Path]:
    """Give a temporary path beside ``path`` to write; when the block ends cleanly it is
    fsynced and renamed over ``path`` and the directory fsynced, so readers see the old
    file or the whole new one. If the block raises, the temporary is removed, ``path`` is
    unchanged and the exception propagates. ``keep_suffix``: see ``temp_path``."""
    tmp = temp_path(path, keep_suffix=keep_suffix)
    try:
        yield tmp
        fsync_path(tmp)
        kill_point("atomic.written", path.name)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    kill_point("atomic.replaced", path.name)
    fsync_path(path.parent)


@contextlib.contextmanager
def atomic_write(path: Path, mode: str = "wb", keep_suffix: bool = False) -> Iterator[IO[Any]]:
    """``atomic_path`` with the temporary opened in ``mode`` ("wb" or "w")."""
    with atomic_path(path, keep_suffix) as tmp, open(tmp, mode) as f:
        yield f


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` so that readers see the old file or the whole new one."""
    with atomic_write(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


@contextlib.contextmanager
def file_lock(path: Path, wait: bool = True) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (created if missing) for the block. The kernel
    releases it when the process dies, so a kill never leaves it held. Raises OSError if
    the file cannot be opened (a read-only directory), BlockingIOError if ``wait`` is False
    and another holds it. Without fcntl (Windows) it does not lock."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        if sys.platform != "win32":
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def remove_tree(path: Path) -> None:
    """Delete the directory tree, file or link at ``path``. Never raises: what cannot be
    removed stays (the next ``sweep_stale`` tries again)."""
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink()
            return
    except OSError:
        return
    shutil.rmtree(path, ignore_errors=True)
