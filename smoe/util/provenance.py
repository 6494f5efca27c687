"""Where a benchmark's figures came from: the command, the commit and the machine, stamped
on every report `smoe bench` and the bench/ scripts print (results/README.md), so that a
figure in the docs can be traced and run again."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]


def commit() -> str | None:
    """The checkout's commit (with "+dirty" when files differ from it), or None when S-MoE
    does not run from a git checkout."""
    try:
        head = subprocess.run(
            ["git", "-C", str(_REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(_REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def machine() -> dict[str, Any]:
    """The machine, in the terms the figures depend on: CPU model and cores, memory, and
    the GPU where MLX sees one."""
    info: dict[str, Any] = {
        "system": platform.system(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_bytes": _memory_bytes(),
    }
    mlx = sys.modules.get("mlx.core")  # only where the run imported MLX: no import here
    if mlx is not None:
        try:
            info["mlx"] = mlx.__version__
            if mlx.default_device() == mlx.gpu:
                info["gpu"] = mlx.device_info().get("device_name")
        except Exception:  # a device query is a nicety here, never the report's end
            pass
    return info


def stamp(report: dict[str, Any], argv: list[str] | None = None) -> dict[str, Any]:
    """``report`` with its provenance: ``command`` (as typed), ``commit``, ``machine`` and
    ``date``, unless it carries them already."""
    if argv is None:
        first = sys.argv[0]
        ours = Path(first).name in ("smoe", "cli.py", "__main__.py")
        argv = ["smoe" if ours else f"python {first}", *sys.argv[1:]]
    cmd = " ".join([argv[0], shlex.join(argv[1:])]).strip()
    found = {
        "command": cmd,
        "commit": commit(),
        "machine": machine(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    return {**report, **{k: v for k, v in found.items() if k not in report}}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
