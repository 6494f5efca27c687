"""User-facing errors: one line that names the problem and the fix.

The CLI prints these without a traceback and exits non-zero; anything else that
escapes is a bug in S-MoE and keeps its traceback.
"""


class SmoeError(Exception):
    """A mistake or condition the user can fix; the message says how."""

    exit_code = 2


class UnsupportedModelError(SmoeError):
    """The checkpoint's architecture cannot be streamed (dense, unknown type, ...)."""


class CheckpointError(SmoeError):
    """The source checkpoint is missing files, truncated, or contradicts its config."""


class VaultError(SmoeError):
    """A vault is missing, incomplete, corrupt, or of another format version."""
