"""Run a command inside a memory cgroup with a hard limit (tests only): what a container of
that size does to a process that outgrows it. cgroup v2 (``memory.max``) or v1
(``memory.limit_in_bytes``), swap off inside the group, so going over the limit is an OOM
kill rather than a slowdown. ``limited`` returns None where no group can be made (not
root, no memory controller): the caller skips."""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

V2 = Path("/sys/fs/cgroup")
V1 = Path("/sys/fs/cgroup/memory")
_names = itertools.count()


@dataclass(frozen=True)
class LimitedRun:
    result: subprocess.CompletedProcess[str]
    limit: int  # bytes, the group's hard limit
    peak: int  # bytes, the group's peak charge (anonymous memory and page cache)
    oom_kills: int  # processes the kernel killed for going over the limit


def _make_group(limit: int) -> tuple[Path, str] | None:
    """A fresh memory group limited to ``limit`` bytes, and its cgroup version."""
    name = f"smoe-test-{os.getpid()}-{next(_names)}"
    if (V2 / "cgroup.controllers").exists() and "memory" in (
        (V2 / "cgroup.subtree_control").read_text()
    ):
        group, files = V2 / name, {"memory.max": limit, "memory.swap.max": 0}
    elif (V1 / "memory.limit_in_bytes").exists():
        group, files = V1 / name, {"memory.limit_in_bytes": limit, "memory.swappiness": 0}
    else:
        return None
    try:
        group.mkdir()
    except OSError:
        return None
    try:
        for file, value in files.items():
            with contextlib.suppress(FileNotFoundError):  # no swap accounting: no swap limit
                (group / file).write_text(str(value))
    except OSError:
        group.rmdir()
        return None
    return group, "v2" if group.parent == V2 else "v1"


def _read_counter(path: Path, key: str) -> int:
    for line in path.read_text().splitlines():
        k, _, v = line.partition(" ")
        if k == key:
            return int(v)
    return 0


def limited(cmd: list[str], limit: int, **kw: object) -> LimitedRun | None:
    """Run ``cmd`` (subprocess.run keyword arguments in ``kw``) as the only member of a
    new memory group limited to ``limit`` bytes; None if no group can be made."""
    made = _make_group(limit)
    if made is None:
        return None
    group, version = made
    procs = group / "cgroup.procs"

    def join() -> None:  # in the child, before exec: everything it maps is charged
        procs.write_text(str(os.getpid()))

    try:
        result = subprocess.run(cmd, preexec_fn=join, **kw)  # type: ignore[call-overload]
        if version == "v2":
            peak = (
                int((group / "memory.peak").read_text()) if (group / "memory.peak").exists() else 0
            )
            kills = _read_counter(group / "memory.events", "oom_kill")
        else:
            peak = int((group / "memory.max_usage_in_bytes").read_text())
            kills = _read_counter(group / "memory.oom_control", "oom_kill")
        return LimitedRun(result, limit, peak, kills)
    finally:
        with contextlib.suppress(OSError):
            group.rmdir()


@contextlib.contextmanager
def limited_popen(cmd: list[str], limit: int, **kw: object):
    """``subprocess.Popen(cmd, **kw)`` as the only member of a new memory group limited to
    ``limit`` bytes, for a process the caller talks to (a server); yields ``(process,
    counts)`` where ``counts()`` gives the group's ``(peak, oom_kills)`` so far, or yields
    None where no group can be made. The process is killed on exit if still running."""
    made = _make_group(limit)
    if made is None:
        yield None
        return
    group, version = made
    procs = group / "cgroup.procs"

    def join() -> None:
        procs.write_text(str(os.getpid()))

    def counts() -> tuple[int, int]:
        if version == "v2":
            peak_file = group / "memory.peak"
            peak = int(peak_file.read_text()) if peak_file.exists() else 0
            return peak, _read_counter(group / "memory.events", "oom_kill")
        peak = int((group / "memory.max_usage_in_bytes").read_text())
        return peak, _read_counter(group / "memory.oom_control", "oom_kill")

    process = subprocess.Popen(cmd, preexec_fn=join, **kw)  # type: ignore[call-overload]
    try:
        yield process, counts
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        with contextlib.suppress(OSError):
            group.rmdir()
