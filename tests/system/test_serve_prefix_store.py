"""`smoe serve --prefix-cache-dir`: a restarted server answers a repeated long prompt from
the KV cache it wrote to disk, with the tokens it gives without one; a damaged, foreign or
half-written entry is ignored with one warning; the directory stays under its bound."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from smoe.engine import Engine
from smoe.engine import prefix_store as store_module
from smoe.serve.app import Server, ServerOptions
from tests import serving
from tests.conftest import tiny_vault

pytestmark = pytest.mark.asyncio

MIN = 16  # the tiny model's prompts are short: a low threshold for the tests


@pytest.fixture(scope="module")
def vaults(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix-store")
    return tiny_vault(root / "a", seed=12), tiny_vault(root / "b", seed=13)


class Running(serving.Running):
    def __init__(self, engine: Engine, directory: Path | None, **kw: Any) -> None:
        options = ServerOptions(
            prefix_dir=directory, prefix_min_tokens=MIN, prewarm_when_idle=False, **kw
        )
        super().__init__(engine, options, Server(engine, options))

    async def complete(self, ids: list[int], n: int = 12) -> dict[str, Any]:
        body = {"prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        async with (
            aiohttp.ClientSession() as http,
            http.post(self.base + "/v1/completions", json=body) as r,
        ):
            assert r.status == 200, await r.text()
            return await r.json()  # type: ignore[no-any-return]

    async def store_stats(self) -> dict[str, Any]:
        async with aiohttp.ClientSession() as http, http.get(self.base + "/v1/smoe/stats") as r:
            return (await r.json())["prefix_store"]  # type: ignore[no-any-return]


def prompt(n: int, seed: int) -> list[int]:
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed).integers(10, 200, n)]


def reply_of(reply: dict[str, Any]) -> tuple[str, int]:
    choice = reply["choices"][0]
    return choice["text"], reply["usage"]["completion_tokens"]


async def answers(vault: Any, directory: Path | None, prompts: list[list[int]]) -> list[Any]:
    """Each prompt's reply from a fresh engine and server (a restart), in order."""
    out = []
    async with Engine.open(vault.path) as engine, Running(engine, directory) as srv:
        for ids in prompts:
            out.append(reply_of(await srv.complete(ids)))
        if srv.server.store is not None:
            await srv.server.store.aclose()
    return out


def entries(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix == ".safetensors")


async def test_a_restarted_server_reuses_a_long_prompt_written_before(vaults, tmp_path):
    vault = vaults[0]
    system = prompt(40, 1)
    first, again = [*system, *prompt(5, 2)], [*system, *prompt(7, 3)]
    [want_first, want_again] = await answers(vault, None, [first, again])
    # The first run writes the first prompt's cache ...
    async with Engine.open(vault.path) as engine, Running(engine, tmp_path) as srv:
        assert reply_of(await srv.complete(first)) == want_first
        await srv.server.store.aclose()
        stats = await srv.store_stats()
        assert stats["writes"] == 1 and stats["hits"] == 0 and stats["entries"] == 1
    assert len(entries(tmp_path)) == 1
    # ... and the next process starts from it: only the new tail is prefilled.
    async with Engine.open(vault.path) as engine, Running(engine, tmp_path) as srv:
        assert reply_of(await srv.complete(again)) == want_again
        stats = await srv.store_stats()
        assert stats["hits"] == 1 and stats["reused_tokens"] == len(system)
        assert srv.server.reused_tokens == len(system)
        assert srv.server.prefilled_tokens == len(again) - 1 - len(system)


async def test_a_short_prompt_or_one_already_held_is_not_written(vaults, tmp_path, monkeypatch):
    import threading

    publish, release = store_module._publish, threading.Event()

    def held(tmp: Path, path: Path) -> Any:  # the first write stays under way ...
        release.wait(60)
        return publish(tmp, path)

    monkeypatch.setattr(store_module, "_publish", held)
    vault = vaults[0]
    long_ = prompt(40, 4)
    async with Engine.open(vault.path) as engine, Running(engine, tmp_path) as srv:
        await srv.complete(prompt(3, 5))  # prompt and reply: under MIN ids cached
        await srv.complete(long_)
        await srv.complete([*long_[:-1], 7])  # ... while this adds fewer than MIN ids to it
        release.set()
        await srv.server.store.aclose()
        assert (await srv.store_stats())["writes"] == 1
    assert len(entries(tmp_path)) == 1


async def test_a_damaged_entry_is_ignored_with_one_warning(vaults, tmp_path, caplog):
    vault = vaults[0]
    ids = [*prompt(40, 6), 9]
    [want] = await answers(vault, None, [ids])
    await answers(vault, tmp_path, [ids])
    [path] = entries(tmp_path)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x40  # in the last KV array's bytes: only the digest can tell
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="smoe.serve"):
        async with Engine.open(vault.path) as engine, Running(engine, tmp_path) as srv:
            assert reply_of(await srv.complete(ids)) == want
            assert reply_of(await srv.complete([*ids[:-1], 11])) is not None
            stats = await srv.store_stats()
    warned = [r.getMessage() for r in caplog.records if "prefix cache" in r.getMessage()]
    assert len(warned) == 1 and "checksum" in warned[0], warned
    assert stats["hits"] == 0 and stats["ignored"] == 1


async def test_foreign_and_garbage_entries_are_left_alone(vaults, tmp_path, caplog):
    mine, other = vaults
    ids = [*prompt(40, 7), 3]
    await answers(other, tmp_path, [ids])  # another model's entry
    (tmp_path / "junk.safetensors").write_bytes(os.urandom(100))
    (tmp_path / "huge.safetensors").write_bytes((2**62).to_bytes(8, "little") + b"{}")
    [want] = await answers(mine, None, [ids])
    with caplog.at_level(logging.WARNING, logger="smoe.serve"):
        got = await answers(mine, tmp_path, [ids])
    assert got == [want]
    warned = [r.getMessage() for r in caplog.records if "prefix cache" in r.getMessage()]
    assert len(warned) == 1 and "3 entries ignored" in warned[0], warned
    assert len(entries(tmp_path)) == 4  # nothing of the others' removed; ours written


async def test_a_temporary_left_by_a_killed_writer_is_swept(vaults, tmp_path):
    stale = tmp_path / ".abc.tmp-999999999.safetensors"  # a PID that does not run
    stale.write_bytes(b"half")
    await answers(vaults[0], tmp_path, [])
    assert not stale.exists()


async def test_a_failed_write_leaves_nothing_and_the_request_is_answered(
    vaults, tmp_path, monkeypatch, caplog
):
    import mlx_lm.models.cache as mlx_cache

    def full_disk(path: str, *a: Any, **kw: Any) -> None:
        Path(path).write_bytes(b"part")  # what a write cut short leaves
        raise RuntimeError("[save_safetensors] No space left on device")

    monkeypatch.setattr(mlx_cache, "save_prompt_cache", full_disk)
    ids = [*prompt(40, 8), 5]
    [want] = await answers(vaults[0], None, [ids])
    with caplog.at_level(logging.WARNING, logger="smoe.serve"):
        async with Engine.open(vaults[0].path) as engine, Running(engine, tmp_path) as srv:
            assert reply_of(await srv.complete(ids)) == want
            await srv.server.store.aclose()
            assert (await srv.store_stats())["write_failures"] == 1
    assert list(tmp_path.iterdir()) == []
    assert any("No space left" in r.getMessage() for r in caplog.records)


async def test_the_directory_keeps_under_its_bound_and_drops_what_is_extended(vaults, tmp_path):
    vault = vaults[0]
    a, b = prompt(40, 9), prompt(40, 10)
    async with Engine.open(vault.path) as engine, Running(engine, tmp_path) as srv:
        await srv.complete(a)
        await srv.server.store.aclose()
        [one] = entries(tmp_path)
        # A follow-up extending it replaces it (it is never the longest match again).
        meta = store_module.read_header(one)
        assert meta is not None
        reply = await srv.complete([*json.loads(meta["tokens"]), *prompt(30, 11)])
        assert reply["choices"][0]["text"] is not None
        await srv.server.store.aclose()
        assert len(entries(tmp_path)) == 1 and not one.exists()
        size = entries(tmp_path)[0].stat().st_size
    # Room for one entry: the older goes when another is written.
    async with (
        Engine.open(vault.path) as engine,
        Running(engine, tmp_path, prefix_dir_bytes=int(size * 1.5)) as srv,
    ):
        await srv.complete(b)
        await srv.server.store.aclose()
        stats = await srv.store_stats()
    [kept] = entries(tmp_path)
    meta = store_module.read_header(kept)
    assert meta is not None and json.loads(meta["tokens"])[:40] == b
    assert stats["entries"] == 1 and stats["bytes"] <= stats["max_bytes"]
