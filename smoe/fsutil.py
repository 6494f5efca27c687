"""Crash-safe file system helpers: write to a temporary name, fsync, rename."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (so that renames inside it are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` so that readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    fsync_path(path.parent)


def replace_dir(tmp: Path, dst: Path) -> None:
    """Move the finished directory ``tmp`` to ``dst``, replacing what is there.

    The old ``dst`` is renamed aside first and deleted only after the new one is in place,
    so at every instant ``dst`` is either the old complete directory or the new one.
    """
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.rename(dst, old)
    os.rename(tmp, dst)
    fsync_path(dst.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
