"""The learning cache: per-vault popularity kept across runs, idle pre-warm, hot set."""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from smoe.engine import Engine
from smoe.sched.popularity import Popularity
from smoe.sched.types import Priority, SlotState
from tests.conftest import tiny_vault

pytestmark = pytest.mark.asyncio


@pytest.fixture
def vault(tmp_path_factory):
    root = tmp_path_factory.mktemp("learn")
    return tiny_vault(root, seed=9)


async def drain(engine):
    """Wait for the pre-warm reads (real I/O threads: poll the scheduler)."""
    sched = engine.debug.scheduler
    while sched.in_flight or sched.queue_depth(Priority.SPECULATIVE):  # noqa: ASYNC110
        await asyncio.sleep(0.005)


async def test_popularity_is_kept_per_vault_and_merged(vault, tmp_path):
    async with Engine.open(vault.path) as engine:
        await engine.logits(list(range(5, 70)))
        first = engine.debug.popularity.session.sum()
    assert first > 0
    saved = Popularity(vault).counts
    assert saved.sum() == first
    other = tmp_path / "other"
    shutil.copytree(vault.path, other)
    (other / "stats" / "popularity.npz").unlink()
    async with Engine.open(vault.path) as engine:
        await engine.logits(list(range(5, 70)))
    assert Popularity(vault).counts.sum() == 2 * first  # merged, not overwritten
    from smoe.vault.format import Vault

    assert Popularity(Vault.open(other)).counts.sum() == 0  # never shared between vaults
    assert not list((vault.path / "stats").glob(".*"))  # no temp files left


async def test_prewarm_fills_only_empty_slots_and_changes_no_bit(vault):
    prompt = list(range(20, 90))
    async with Engine.open(vault.path, slots=10) as engine:
        await engine.logits(list(range(5, 40)))  # history
        expected = await engine.logits(prompt)
    async with Engine.open(vault.path, slots=10) as engine:
        queued = engine.learning.prewarm()
        assert queued == 10  # an empty ring: every slot gets a hot expert
        await drain(engine)
        hot = engine.debug.popularity.hottest(10)
        assert all(engine.debug.scheduler.state_of(k) is SlotState.READY for k in hot)
        assert engine.learning.prewarm() == 0  # the ring is full: pre-warm never evicts
        assert np.array_equal(await engine.logits(prompt), expected)


async def test_prewarm_of_a_ring_that_holds_the_model_makes_it_resident(vault):
    """Where the ring holds every expert, pre-warm reads all of them (not only those with a
    history): the next request pins them for good, and decode is built ahead as in memory,
    with the tokens it gives on a cold ring."""
    every = vault.manifest.num_records
    prompt = [20, 21]
    async with Engine.open(vault.path, slots=every) as engine:
        cold = [e.token async for e in engine.generate(prompt, max_tokens=6) if e.token is not None]
        assert engine.stats().ring.filled < every  # some experts were never read: streamed
        assert engine.debug.runner.built_ahead == 0
    (vault.path / "stats" / "popularity.npz").unlink()  # no history to go by
    async with Engine.open(vault.path, slots=every) as engine:
        assert engine.learning.prewarm() == every
        await drain(engine)
        assert engine.stats().ring.filled == every
        warm = [e.token async for e in engine.generate(prompt, max_tokens=6) if e.token is not None]
        assert engine.debug.runner.resident() and engine.debug.runner.built_ahead > 0
        assert warm == cold


async def test_demand_drops_queued_prewarm(vault):
    async with Engine.open(vault.path, slots=10, workers=1) as engine:
        await engine.logits(list(range(5, 40)))
    async with Engine.open(vault.path, slots=10, workers=1) as engine:
        engine.learning.prewarm()
        assert engine.debug.scheduler.queue_depth(Priority.SPECULATIVE) > 0
        task = asyncio.get_running_loop().create_task(engine.logits([7, 8, 9]))
        await asyncio.sleep(0)  # let the request start
        await task
        # the request dropped the bets that had not started (at most `workers` ran)
        cancelled = engine.stats().scheduler.by_priority[Priority.SPECULATIVE].cancelled
        assert cancelled > 0
        engine.debug.scheduler.check_invariants()


async def test_hot_policy_pins_the_history(vault):
    async with Engine.open(vault.path) as engine:
        await engine.logits(list(range(5, 70)))
    async with Engine.open(vault.path, slots=8, policy="hot") as engine:
        assert len(engine.debug.scheduler.policy.hot) == 4
        await engine.logits(list(range(5, 30)))
        engine.debug.scheduler.check_invariants()


# ------------------------------------------------------------------ robustness (issue 13)


@pytest.fixture(scope="module")
def shared_vault(tmp_path_factory):
    root = tmp_path_factory.mktemp("learn-shared")
    return tiny_vault(root, seed=9)


def fresh_copy(vault, tmp_path):
    from smoe.vault.format import Vault

    shutil.copytree(vault.path, tmp_path / "v")
    return Vault.open(tmp_path / "v")


def _npz(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _bad_files(shape):
    good = _npz(counts=np.ones(shape))
    npy = io.BytesIO()
    np.save(npy, np.ones(shape))
    return {
        "truncated": good[: len(good) // 2],
        "zip-like": b"PK\x03\x04" + b"\x00" * 200,
        "empty": b"",
        "junk": b"not a numpy file at all",
        "npy-not-npz": npy.getvalue(),
        "no-counts": _npz(other=np.ones(shape)),
        "wrong-shape": _npz(counts=np.ones((shape[0] + 1, shape[1]))),
        "nan": _npz(counts=np.full(shape, np.nan)),
        "negative": _npz(counts=-np.ones(shape)),
        "strings": _npz(counts=np.array(["a", "b"])),
    }


BAD = list(_bad_files((2, 2)))


@pytest.mark.parametrize("kind", BAD)
async def test_a_bad_popularity_file_is_set_aside_with_a_warning(kind, shared_vault, tmp_path):
    vault = fresh_copy(shared_vault, tmp_path)
    shape = (len(vault.manifest.layers), vault.manifest.num_experts)
    path = vault.stats_dir / "popularity.npz"
    path.write_bytes(_bad_files(shape)[kind])
    with pytest.warns(UserWarning, match=r"ignoring expert popularity .*counting afresh") as got:
        pop = Popularity(vault)
    assert len(got) == 1 and "\n" not in str(got[0].message)
    assert not pop.counts.any()
    assert (vault.stats_dir / "popularity.npz.corrupt").read_bytes() == _bad_files(shape)[kind]
    pop.add_counts(pop.layers, np.ones(shape))
    assert pop.save() == path
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a good file again: no more warnings
        assert np.array_equal(Popularity(vault).counts, np.ones(shape))


async def test_engine_opens_a_vault_whose_popularity_is_truncated(shared_vault, tmp_path):
    vault = fresh_copy(shared_vault, tmp_path)
    good = _npz(counts=np.ones((len(vault.manifest.layers), vault.manifest.num_experts)))
    (vault.stats_dir / "popularity.npz").write_bytes(good[:100])
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        async with Engine.open(vault.path) as engine:
            await engine.logits(list(range(5, 30)))
            counted = engine.debug.popularity.session.sum()
    assert [str(w.message) for w in got if "popularity" in str(w.message)] == [
        f"ignoring expert popularity {vault.stats_dir / 'popularity.npz'}: unreadable "
        "(BadZipFile: File is not a zip file); moved to popularity.npz.corrupt; counting afresh"
    ]
    assert Popularity(vault).counts.sum() == counted > 0


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # p.pid: a process that no longer runs
    return p.pid


async def test_dead_saves_temporaries_are_swept_when_the_vault_opens(shared_vault, tmp_path):
    vault = fresh_copy(shared_vault, tmp_path)
    dead = vault.stats_dir / f".popularity.tmp-{_dead_pid()}.npz"
    live = vault.stats_dir / f".popularity.tmp-{os.getppid()}.npz"
    other = vault.stats_dir / "notes.txt"
    for f in (dead, live, other):
        f.write_bytes(b"partial")
    Popularity(vault)
    assert not dead.exists() and live.exists() and other.exists()


ROOT = str(Path(__file__).resolve().parents[2])
CONCURRENT = """
import sys
import numpy as np
from smoe.sched.popularity import Popularity
from smoe.vault.format import Vault

pop = Popularity(Vault.open(sys.argv[1]))
i = int(sys.argv[2])
pop.add_counts(pop.layers, np.arange(pop.counts.size).reshape(pop.counts.shape) * i + i)
print("loaded", flush=True)
assert sys.stdin.readline() == "go\\n"  # every process has loaded before any saves
pop.save()
"""


def _run_together(vault_path, n: int) -> list[int]:
    """Start n CONCURRENT processes, let them all load, then let them all save."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONCURRENT, str(vault_path), str(i)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(1, n + 1)
    ]
    for p in procs:
        assert p.stdout.readline() == "loaded\n"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    return [p.wait(timeout=120) for p in procs]


async def test_concurrent_processes_keep_every_count(shared_vault, tmp_path):
    """Six processes load, then all save at once: the file holds the sum of all of them."""
    vault = fresh_copy(shared_vault, tmp_path)
    base = Popularity(vault)
    base.add_counts(base.layers, np.full(base.counts.shape, 1000.0))
    base.save()
    n = 6
    assert _run_together(vault.path, n) == [0] * n
    grid = np.arange(base.counts.size).reshape(base.counts.shape)
    expected = 1000.0 + sum(grid * i + i for i in range(1, n + 1))
    assert np.array_equal(Popularity(vault).counts, expected)
    assert sorted(p.name for p in vault.stats_dir.iterdir()) == [
        "popularity.lock",
        "popularity.npz",
    ]


async def test_opening_never_waits_for_a_held_lock(shared_vault, tmp_path):
    """A save holding the lock (say, a stopped process) must not block opening the vault."""
    import threading

    from smoe.util.files import file_lock

    vault = fresh_copy(shared_vault, tmp_path)
    pop = Popularity(vault)
    pop.add_counts(pop.layers, np.ones(pop.counts.shape))
    pop.save()
    got = []
    with file_lock(vault.stats_dir / "popularity.lock"):
        t = threading.Thread(target=lambda: got.append(Popularity(vault).counts))
        t.start()
        t.join(timeout=60)  # only a regression waits: then it fails instead of hanging
    t.join()
    assert len(got) == 1 and np.array_equal(got[0], np.ones(pop.counts.shape))


async def test_counts_add_per_layer_whether_a_layer_comes_once_or_again(shared_vault, tmp_path):
    pop = Popularity(fresh_copy(shared_vault, tmp_path))
    layers, e = pop.layers, pop.counts.shape[1]
    counts = np.arange(len(layers) * e).reshape(len(layers), e)
    pop.add_counts(layers[::-1], counts[::-1])  # a pass: each layer once, in any order
    assert np.array_equal(pop.session, counts)
    pop.add_counts([layers[0], layers[0]], np.ones((2, e)))  # the same layer twice: both add
    assert np.array_equal(pop.session[0], counts[0] + 2)
    assert np.array_equal(pop.session[1:], counts[1:])


async def test_a_vault_replaced_while_running_does_not_get_the_old_counts(shared_vault, tmp_path):
    """`smoe convert --force` under a running server replaced the folder, and the server's
    save on exit wrote the old model's counts into the new vault (issue 30)."""
    import json
    import shutil

    path = fresh_copy(shared_vault, tmp_path).path
    pop = Popularity(shared_vault.open(path))
    pop.add_counts(pop.layers, np.ones(pop.shape))
    other = tmp_path / "other"
    shutil.copytree(path, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["created_by"] = "another conversion"  # any other manifest
    (other / "manifest.json").write_text(json.dumps(manifest))
    shutil.rmtree(path)
    other.rename(path)  # the folder now holds another vault
    with pytest.warns(UserWarning, match="replaced by another vault"):
        assert pop.save() is None
    assert not (path / "stats" / "popularity.npz").exists()
