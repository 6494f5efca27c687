"""kill -9 at exact points: every target stays the old or the new complete state, and the next
start removes what the dead process left.

Each child process kills itself with SIGKILL when it reaches the point named by the test
hook $SMOE_TEST_KILL_AT (smoe.util.files.kill_point), so no timing is involved.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from smoe.errors import SmoeError
from smoe.sched.popularity import Popularity
from smoe.synth import synthesize
from smoe.telemetry.archive import RoutingArchive
from smoe.util.files import parse_temp, recover_dir, replace_dir, sweep_stale
from smoe.vault.convert import ConvertOptions, convert
from smoe.vault.format import Vault

ROOT = Path(__file__).resolve().parents[2]


def run_child(code: str, kill_at: str | None, *args: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SMOE_TEST_KILL_AT", None)
    if kill_at is not None:
        env["SMOE_TEST_KILL_AT"] = kill_at
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def assert_killed(p: subprocess.CompletedProcess[str]) -> None:
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr[-2000:])


def dead_pid() -> int:
    """The PID of a process that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    with pytest.raises(ProcessLookupError):
        os.kill(p.pid, 0)
    return p.pid


def hidden(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith("."))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(source checkpoint, a 4-bit vault to copy as the "old" state)."""
    root = tmp_path_factory.mktemp("crash")
    src = synthesize(root / "src", arch="qwen3_moe", preset="tiny", seed=3)
    old = convert(src, root / "old", ConvertOptions(dtype="float32"))
    return src, old.path


# ------------------------------------------------------------------ convert

CONVERT = """
    import sys
    import smoe.util.files as fsutil
    from smoe.vault.convert import ConvertOptions, convert

    src, dst, no_exchange = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    if no_exchange:  # what systems without an atomic exchange get: two renames
        def refuse(a, b):
            raise OSError(22, "no exchange here (test)")
        fsutil.exchange = refuse

    def progress(stage, done, total):
        fsutil.kill_point("convert." + stage, str(done))

    convert(src, dst, ConvertOptions(force=True, bits=8, dtype="float32"), progress=progress)
"""


@pytest.mark.parametrize(
    ("point", "no_exchange", "after_kill"),
    [
        ("convert.experts:1", False, "old"),  # while writing the expert records
        ("atomic.written:manifest.json", False, "old"),  # all written but the manifest rename
        ("replace_dir.exchanged:v", False, "new"),  # swapped; old tree not yet deleted
        ("replace_dir.aside:v", True, "missing"),  # fallback: between the two renames
        ("replace_dir.swapped:v", True, "new"),  # fallback: both renames, old tree left
    ],
)
def test_convert_killed(point, no_exchange, after_kill, made, tmp_path):
    src, old = made
    v = tmp_path / "v"
    shutil.copytree(old, v)
    before = (v / "manifest.json").read_text()

    assert_killed(run_child(CONVERT, point, src, v, int(no_exchange)))
    assert hidden(tmp_path)  # the kill left its temporaries
    bits = {"old": 4, "new": 8}
    if after_kill == "missing":
        assert not v.exists()
        # Opening it (smoe chat, generate...) finishes the swap: the new tree was complete.
        assert Vault.open(v).manifest.quantization["experts"]["bits"] == bits["new"]
    else:
        assert Vault.open(v).manifest.quantization["experts"]["bits"] == bits[after_kill]
        if after_kill == "old":
            assert (v / "manifest.json").read_text() == before

    # The next start (any convert to v) repairs and sweeps, and still refuses to overwrite.
    with pytest.raises(SmoeError, match="pass --force"):
        convert(src, v)
    assert os.listdir(tmp_path) == ["v"]
    final = "new" if after_kill == "missing" else after_kill  # the new tree was complete
    assert Vault.open(v).manifest.quantization["experts"]["bits"] == bits[final]


def test_interrupted_swap_with_an_incomplete_new_tree_puts_the_old_back(tmp_path):
    pid = dead_pid()
    (tmp_path / f".v.old-{pid}").mkdir()
    (tmp_path / f".v.old-{pid}" / "manifest.json").write_text("old")
    (tmp_path / f".v.converting-{pid}").mkdir()  # no manifest: never finished
    assert recover_dir(tmp_path / "v", complete=lambda p: (p / "manifest.json").is_file())
    assert (tmp_path / "v" / "manifest.json").read_text() == "old"
    assert sweep_stale(tmp_path) == [tmp_path / f".v.converting-{pid}"]
    assert os.listdir(tmp_path) == ["v"]


def test_replace_dir_fallback_puts_the_old_tree_back_when_the_second_rename_fails(
    tmp_path, monkeypatch
):
    import smoe.util.files as fsutil

    (tmp_path / "new").mkdir()
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "f").write_text("old")

    def refuse(a, b):
        raise OSError(22, "no exchange here (test)")

    real = os.rename

    def rename(a, b):
        if Path(a).name == "new":
            raise OSError(5, "I/O error (test)")
        real(a, b)

    monkeypatch.setattr(fsutil, "exchange", refuse)
    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="test"):
        replace_dir(tmp_path / "new", tmp_path / "v")
    assert (tmp_path / "v" / "f").read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["new", "v"]


# ------------------------------------------------------------------ conversation

CHAT = """
    import asyncio, json, os, sys
    from smoe.engine import Engine

    vault, chat, point = sys.argv[1:4]

    async def turn(conv, text):
        async for _ in conv.send(text, max_tokens=3):
            pass

    async def main():
        async with Engine.open(vault) as engine:
            conv = engine.conversation(system="sys")
            await turn(conv, "First?")
            await conv.save(chat)
            print(json.dumps(conv.messages), flush=True)
            await turn(conv, "Second?")
            print(json.dumps(conv.messages), flush=True)
            os.environ["SMOE_TEST_KILL_AT"] = point
            await conv.save(chat)

    asyncio.run(main())
"""


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("point", "after_kill"),
    [("atomic.written:chat.safetensors", "old"), ("atomic.replaced:chat.safetensors", "new")],
)
async def test_conversation_save_killed(point, after_kill, made, tmp_path):
    from smoe.engine import Engine

    _, vault = made
    chats = tmp_path / "chats"
    chats.mkdir()
    chat = chats / "chat.safetensors"
    p = run_child(CHAT, None, vault, chat, point)
    assert_killed(p)
    old, new = (json.loads(line) for line in p.stdout.splitlines()[:2])
    if after_kill == "old":  # the dead save's complete temporary was never renamed
        assert _child_pid(chats) not in (os.getpid(), os.getppid())
    else:
        assert hidden(chats) == []
    live = chats / f".chat.tmp-{os.getppid()}.safetensors"  # a live writer's: kept
    live.write_bytes(b"partial")
    (chats / ".chat.bak").write_bytes(b"not ours")  # not our naming: kept
    async with Engine.open(vault) as engine:
        loaded = await engine.load_conversation(chat)
        assert loaded.messages == (old if after_kill == "old" else new)
        await loaded.save(chat)  # the next save sweeps the dead save's temporary
        with pytest.raises(SmoeError, match="cannot save the conversation"):
            await loaded.save(tmp_path / "missing" / "chat")
    assert hidden(chats) == sorted([".chat.bak", live.name])


def _child_pid(d: Path) -> int:
    (name,) = [n for n in os.listdir(d) if n.startswith(".chat.tmp-")]
    t = parse_temp(name)
    assert t is not None and t.target == "chat.safetensors"
    return t.pid


# ------------------------------------------------------------------ popularity

POPULARITY = """
    import sys
    import numpy as np
    from smoe.sched.popularity import Popularity
    from smoe.vault.format import Vault

    p = Popularity(Vault.open(sys.argv[1]))
    p.add_counts(p.layers, np.full(p.counts.shape, float(sys.argv[2])))
    p.save()
"""


@pytest.mark.parametrize(
    ("point", "after_kill"),
    [
        ("popularity.locked", "old"),  # holding the lock: the kernel must release it
        ("atomic.written:popularity.npz", "old"),
        ("atomic.replaced:popularity.npz", "old+new"),
    ],
)
def test_popularity_save_killed(point, after_kill, made, tmp_path):
    _, old = made
    v = tmp_path / "v"
    shutil.copytree(old, v)
    first = Popularity(Vault.open(v))
    first.add_counts(first.layers, np.full(first.counts.shape, 2.0))
    first.save()

    assert_killed(run_child(POPULARITY, point, v, 5.0))
    temps = hidden(v / "stats")
    assert len(temps) == (1 if point.startswith("atomic.written") else 0)
    again = Popularity(Vault.open(v))  # the next start sweeps; it does not wait on a lock
    assert hidden(v / "stats") == []
    assert np.array_equal(
        again.counts, np.full(first.counts.shape, 2.0 if after_kill == "old" else 7.0)
    )
    again.add_counts(again.layers, np.ones(again.counts.shape))
    assert again.save() is not None


# ------------------------------------------------------------------ routing archive

ARCHIVE = """
    import sys
    import numpy as np
    from smoe.telemetry.archive import RoutingArchive

    n = int(sys.argv[2])
    RoutingArchive(
        8, 2, [1, 2], np.zeros((n, 2, 4), np.uint16), np.arange(n, dtype=np.int32),
        np.zeros(n, np.uint8),
    ).save(sys.argv[1])
"""


@pytest.mark.parametrize(
    ("point", "tokens"), [("atomic.written:run.npz", 3), ("atomic.replaced:run.npz", 5)]
)
def test_archive_save_killed(point, tokens, tmp_path):
    path = tmp_path / "run.npz"
    assert run_child(ARCHIVE, None, path, 3).returncode == 0
    assert_killed(run_child(ARCHIVE, point, path, 5))
    assert RoutingArchive.load(path).num_tokens == tokens
    RoutingArchive.load(path).save(path)  # the next save sweeps
    assert hidden(tmp_path) == []
    with pytest.raises(SmoeError, match="cannot write routing archive"):
        RoutingArchive.load(path).save(tmp_path / "missing" / "run")


# ------------------------------------------------------------------ the sweeper itself


def test_sweep_removes_only_dead_processes_temporaries(tmp_path):
    dead, live = dead_pid(), os.getppid()
    ours = [f".v.converting-{dead}", f".chat.tmp-{dead}.safetensors", f".x.json.tmp-{dead}"]
    kept = [
        f".v.converting-{live}",  # a live process's
        f".v.converting-{os.getpid()}",  # this process's
        f".w.old-{dead}",  # the only copy of w (missing): recover_dir's to put back
        f".v.backup-{dead}",  # not one of our kinds
        f"v.converting-{dead}",  # not hidden: not ours
        ".v.converting-0",  # PID 0 is a process group, never a writer
        f".v.converting-{dead}x",
        "v",
    ]
    for name in ours + kept:
        (tmp_path / name).mkdir() if "converting" in name else (tmp_path / name).write_text("")
    (tmp_path / f".v.converting-{dead}" / "experts.bin").write_bytes(b"x" * 4096)
    assert sweep_stale(tmp_path, targets=["chat.safetensors"]) == [
        tmp_path / f".chat.tmp-{dead}.safetensors"
    ]
    assert sorted(sweep_stale(tmp_path)) == sorted(tmp_path / n for n in (ours[0], ours[2]))
    assert sorted(os.listdir(tmp_path)) == sorted(kept)
    assert sweep_stale(tmp_path / "missing") == []


@pytest.mark.parametrize("cut", [0, 10, 200])
def test_a_truncated_archive_is_a_clean_error(cut, tmp_path):
    path = tmp_path / "run.npz"
    assert run_child(ARCHIVE, None, path, 50).returncode == 0
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(SmoeError, match="cannot read routing archive"):
        RoutingArchive.load(path)
