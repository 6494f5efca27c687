"""The suite does not write into the user's own S-MoE cache (tests/_isolated_cache.py):
the cache, the chat history and what a spawned command resolves all lie under pytest's
temporary base, not under the home folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from smoe.chat.repl import history_file
from smoe.util.cache import cache_dir


def _under(path: Path, base: Path) -> bool:
    return path.resolve().is_relative_to(base.resolve())


def test_the_cache_and_the_chat_history_are_the_suites_own(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    home = Path.home() / ".cache" / "smoe"
    assert _under(cache_dir(), base) and not _under(cache_dir(), home)
    history = history_file()
    assert _under(Path(history.filename), base)  # a FileHistory, in the suite's cache
    # a command the suite spawns (`smoe chat`, `smoe plan`) resolves the same folder
    out = subprocess.run(
        [sys.executable, "-c", "from smoe.util.cache import cache_dir; print(cache_dir())"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(out.stdout.strip()) == cache_dir()
