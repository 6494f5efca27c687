"""Writing a vault, a shard or an mlx-lm export when the disk says no (issue 49): a full
disk, an I/O error, a failed fsync or rename, a target that cannot be made. Each is one
line naming the output, the path and the errno, exit 1, and nothing is left beside the
target; what killed runs left there is swept by the next run, as `smoe convert` does.

Faults are injected where the writers call the system (os.fsync, os.rename, os.mkdir, the
writer's own open), in process; kills use the SMOE_TEST_KILL_AT hook (smoe.util.files).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from smoe.vault.format import Vault
from tests.conftest import tiny_vault

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(a tiny vault's folder, the checkpoint it was converted from)."""
    root = tmp_path_factory.mktemp("writefaults")
    vault = tiny_vault(root, seed=7)
    return vault.path, root / "src"


def argv(command: str, made: tuple[Path, Path], out: Path, *extra: str) -> list[str]:
    vault, src = made
    if command == "convert":
        return ["convert", str(src), str(out), "--dtype", "float32", "--quiet", *extra]
    if command == "shard":
        return ["shard", str(vault), str(out), "--ranks", "2", "--rank", "1", "--quiet", *extra]
    return ["export", str(vault), str(out), *extra]


class _FailingWrites:
    """A file opened for writing whose writes fail with ``code``."""

    def __init__(self, f: Any, code: int) -> None:
        self._f, self._code = f, code

    def write(self, data: Any) -> int:
        raise OSError(self._code, os.strerror(self._code))

    def __enter__(self) -> _FailingWrites:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


# The module whose own open() writes each command's bulk data.
WRITER = {
    "export": "smoe.vault.tensorfile",
    "shard": "smoe.parallel.cut",
    "convert": "smoe.vault.convert",
}


def inject(monkeypatch: pytest.MonkeyPatch, command: str, point: str, code: int) -> None:
    def fail(*args: Any, **kwargs: Any) -> Any:
        where = str(args[0]) if point != "fsync" else None  # (fsync's is a descriptor)
        raise OSError(code, os.strerror(code), where)

    if point == "write":
        import importlib

        module = importlib.import_module(WRITER[command])

        def opener(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            f = open(file, mode, *args, **kwargs)  # noqa: SIM115 (closed by the wrapper)
            return _FailingWrites(f, code) if "w" in mode or "a" in mode else f

        monkeypatch.setattr(module, "open", opener, raising=False)
    elif point == "rename":
        monkeypatch.setattr(os, "rename", fail)
        monkeypatch.setattr(os, "replace", fail)
    else:
        monkeypatch.setattr(os, point, fail)


FAULTS = [
    ("write", errno.ENOSPC),
    ("write", errno.EIO),
    ("fsync", errno.EIO),
    ("rename", errno.EIO),
    ("mkdir", errno.EROFS),
]


def test_write_errors_are_one_line_and_leave_nothing(made, tmp_path, run_cli, monkeypatch):
    """ENOSPC or EIO from a write, a failed fsync or rename, a read-only file system: each
    was a traceback from export, shard and convert (convert alone said ENOSPC in a line);
    now one line naming the target and the errno, and the parent folder is as it was."""
    bad = []
    for command in WRITER:
        for point, code in FAULTS:
            case = f"{command}, {point} {errno.errorcode[code]}"
            work = tmp_path / f"{command}-{point}-{code}"
            work.mkdir()
            out = work / "out"
            with monkeypatch.context() as m:
                inject(m, command, point, code)
                try:
                    status, _, err = run_cli(*argv(command, made, out))
                except Exception as e:  # noqa: BLE001 (the old code's traceback: counted)
                    bad.append(f"{case}: {type(e).__name__}: {e}")
                    continue
            lines = [x for x in err.splitlines() if x.strip()]
            name = errno.errorcode[code]
            if status != 1 or len(lines) != 1 or name not in lines[0] or str(out) not in lines[0]:
                bad.append(f"{case}: exit {status}: {err[-300:]}")
            if os.listdir(work):
                bad.append(f"{case}: left {os.listdir(work)}")
    assert not bad, "\n".join(bad)


def test_unwritable_targets_are_one_line(made, tmp_path, run_cli):
    """A target under a file, or on a virtual file system: tracebacks (FileExistsError,
    NotADirectoryError, FileNotFoundError) from mkdir; now one line naming the target."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    bad = []
    for command in WRITER:
        for target in (a_file / "sub", Path("/proc/smoe-test-out")):
            try:
                status, _, err = run_cli(*argv(command, made, target))
            except Exception as e:  # noqa: BLE001 (the old code's traceback: counted)
                bad.append(f"{command} {target}: {type(e).__name__}: {e}")
                continue
            lines = [x for x in err.splitlines() if x.strip()]
            if status != 1 or len(lines) != 1 or str(target.parent) not in lines[0]:
                bad.append(f"{command} {target}: exit {status}: {err[-300:]}")
    assert not bad, "\n".join(bad)
    assert os.listdir(tmp_path) == ["a-file"] and a_file.read_text() == "not a folder"


CHILD = """
    import sys
    import smoe.util.files as fsutil
    from smoe.cli import main

    if sys.argv[1] == "1":  # what systems without an atomic exchange get: two renames
        def refuse(a, b):
            raise OSError(22, "no exchange here (test)")
        fsutil.exchange = refuse
    sys.exit(main(sys.argv[2:]))
"""


def run_killed(kill_at: str, no_exchange: bool, args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SMOE_TEST_KILL_AT": kill_at}
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), str(int(no_exchange)), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr[-2000:])


KILLS: list[tuple[str, str, bool, Callable[[Path], bool]]] = [
    # (command, kill point, no exchange, what the complete output has)
    ("export", "atomic.written:config.json", False, lambda p: (p / "config.json").is_file()),
    ("export", "replace_dir.aside:out", True, lambda p: (p / "config.json").is_file()),
    ("shard", "atomic.written:manifest.json", False, lambda p: Vault.open(p) is not None),
    ("shard", "replace_dir.aside:out", True, lambda p: Vault.open(p) is not None),
]


def test_killed_exports_and_shards_are_swept_by_the_next_run(made, tmp_path, run_cli):
    """A killed export or shard left its `.OUT.exporting-PID` / `.OUT.converting-PID`
    folder, as large as the output, and a --force swap killed between its two renames its
    `.OUT.old-PID`: nothing removed them. The next run now repairs and sweeps them."""
    left = []
    for i, (command, point, no_exchange, complete) in enumerate(KILLS):
        work = tmp_path / str(i)
        work.mkdir()
        out = work / "out"
        if no_exchange:  # a --force replace of an earlier output
            status, _, err = run_cli(*argv(command, made, out))
            assert status == 0, err
        run_killed(point, no_exchange, argv(command, made, out, "--force"))
        assert [n for n in os.listdir(work) if n.startswith(".")], (command, point)
        status, _, err = run_cli(*argv(command, made, out, "--force"))
        assert status == 0, (command, point, err)
        if os.listdir(work) != ["out"]:
            left.append(f"{command} killed at {point}: {sorted(os.listdir(work))}")
        assert complete(out), (command, point)
    assert not left, "\n".join(left)
