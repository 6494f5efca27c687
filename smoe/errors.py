"""User-facing errors: one line that names the problem and the fix.

The CLI prints these without a traceback and exits non-zero; anything else that
escapes is a bug in S-MoE and keeps its traceback.
"""

import errno as _errno


class SmoeError(Exception):
    """A mistake or condition the user can fix; the message says how."""

    # A run that could not be done exits 1, as other tools' do; 2 is argparse's, for a
    # command line that cannot be parsed.
    exit_code = 1


class BudgetTooSmall(SmoeError):
    """--memory cannot hold the backbone, the KV caches, working memory and one layer's
    top-k of experts; the message names the smallest budget that works."""


class UnsupportedModelError(SmoeError):
    """The checkpoint's architecture cannot be streamed (dense, unknown type, ...)."""


class CheckpointError(SmoeError):
    """The source checkpoint is missing files, truncated, or contradicts its config."""


class VaultError(SmoeError):
    """A vault is missing, incomplete, corrupt, or of another format version."""


# What to do about an OS error while writing an output, by errno.
_WRITE_FIXES = {
    _errno.ENOSPC: "the disk filled up: free some space or choose another path",
    _errno.EDQUOT: "the disk quota is used up: free some space or choose another path",
    _errno.EIO: "check the disk (dmesg), then try again or choose another path",
    _errno.EROFS: "that file system is read-only: choose another path",
    _errno.EACCES: "choose a path you may write to",
    _errno.EPERM: "choose a path you may write to",
}


class WriteError(SmoeError):
    """Writing an output (a vault, a shard, an mlx-lm export) failed with an OS error: a
    full disk, an I/O error, a target that cannot be made (a file where a folder must be,
    a read-only or virtual file system). The one line names the output, the path the
    system named, the error (its text and errno name) and the fix. The writer has removed
    its partial output by then; an earlier output at the target is as it was.

    ``target`` is the output's path, ``path`` the failing one (the target's where the
    failure was inside the temporary folder that stood for it), ``errno`` the cause's.
    """

    def __init__(self, what: str, target: object, cause: OSError, tmp: object = None) -> None:
        path = str(cause.filename) if cause.filename is not None else str(target)
        if tmp is not None and path.startswith(str(tmp)):  # name what the user asked for
            path = str(target) + path[len(str(tmp)) :]
        name = _errno.errorcode.get(cause.errno or 0, "no errno")
        text = cause.strerror or str(cause)
        fix = _WRITE_FIXES.get(cause.errno or 0, "choose another path")
        where = "" if path == str(target) else f" at {path}"
        super().__init__(
            " ".join(f"writing {what} {target} failed{where}: {text} ({name}); {fix}".split())
        )
        self.__cause__ = cause
        self.target = target
        self.path = path
        self.errno: int | None = cause.errno


class VaultReadError(VaultError):
    """Reading the vault's expert file failed: an I/O error, a truncated file, or a record
    whose bytes do not match its checksum. The message names the file, the record, its
    layer and expert, and the fix.

    Attributes: ``path`` (the file), ``record`` and ``key`` ((layer, expert); None when the
    failure is not one record's, e.g. the O_DIRECT probe at open), ``errno`` (the OS
    error's, None when there was none, e.g. a truncated file or a checksum mismatch).
    """

    def __init__(
        self,
        message: str,
        *,
        path: object,
        record: int | None = None,
        key: tuple[int, int] | None = None,
        errno: int | None = None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.record = record
        self.key = key
        self.errno = errno


class RecordChecksumError(VaultReadError):
    """A record's bytes did not match the manifest's checksum, read after read (a
    transient bus or DMA error is re-read first): the vault file is corrupt there.
    ``algorithm``, ``expected`` and ``actual`` say which checksum and what it was."""

    def __init__(
        self,
        message: str,
        *,
        path: object,
        record: int,
        key: tuple[int, int],
        algorithm: str,
        expected: int,
        actual: int,
    ) -> None:
        super().__init__(message, path=path, record=record, key=key)
        self.algorithm = algorithm
        self.expected = expected
        self.actual = actual


class ExpertReadError(SmoeError):
    """An expert that a request needs could not be read into the ring; every request
    waiting for that read fails with this error (the scheduler's ``ReadError``).

    ``key`` is (layer, expert), ``record`` the vault record, ``cause`` the read backend's
    exception (also ``__cause__``); ``path`` and ``errno`` are the cause's when it has
    them. The message is one line: the cause's own when it is a SmoeError (a
    VaultReadError names the file, record, layer, expert and fix), else one naming the
    expert, the cause and what to check.
    """

    def __init__(self, key: tuple[int, int], record: int, cause: BaseException) -> None:
        layer, expert = key
        where = f"reading expert {expert} of layer {layer} (record {record}) failed"
        if isinstance(cause, SmoeError):
            message = str(cause)
        elif isinstance(cause, OSError):
            message = (
                f"{where}: {cause}; check the disk (dmesg) and the vault "
                "('smoe inspect VAULT --verify')"
            )
        else:  # not the disk's doing: a bug, whose traceback stays in __cause__
            message = f"{where}: {type(cause).__name__}: {cause} (an internal error)"
        super().__init__(" ".join(message.split()))  # one line, whatever the cause said
        self.__cause__ = cause
        self.key = key
        self.record = record
        self.cause = cause
        self.path = getattr(cause, "path", None) or getattr(cause, "filename", None)
        self.errno: int | None = getattr(cause, "errno", None)


class GroupError(SmoeError):
    """Expert-parallel ranks disagree or lost one another: a rank opened another vault,
    died, or its connection broke. The group cannot go on; restart every rank."""


class Stopped(BaseException):
    """The command was asked to stop by SIGTERM. Raised where the command runs (a
    BaseException, so ``except Exception`` cleanups do not swallow it, while ``finally``
    blocks and context managers still close what they opened); the CLI exits 0 for
    ``smoe serve``, whose normal end it is, and 143 for a command that did not finish."""


class ShuttingDown(SmoeError):
    """The server is stopping: requests in flight end with this (its message is safe to
    send to the client, unlike other failures')."""
