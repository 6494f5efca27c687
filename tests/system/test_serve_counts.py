"""/v1/models gives the vault's creation time, and the server's hit counters (/metrics,
/v1/smoe/stats) go on counting once the ring holds the whole model, as each request's own
statistics do (issue 51: they froze when every expert was resident)."""

from __future__ import annotations

import json
import re
from datetime import datetime

import aiohttp
import pytest

from smoe.engine import Engine
from smoe.serve.app import ServerOptions
from tests.conftest import tiny_vault
from tests.serving import Running

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    return tiny_vault(tmp_path_factory.mktemp("counts"), seed=11)


async def test_models_created_is_the_vaults_creation_time(vault):
    manifest = json.loads((vault.path / "manifest.json").read_text())
    want = int(datetime.fromisoformat(manifest["created"]).timestamp())
    async with Engine.open(vault.path) as engine, Running(engine, ServerOptions()) as srv:
        models = await srv.client().models.list()
        assert models.data[0].created == want > 0


async def get(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url) as r:
        assert r.status == 200
        return await r.text()


async def test_hits_count_once_every_expert_is_resident(vault):
    options = ServerOptions(prewarm_when_idle=False)
    async with (
        Engine.open(vault.path) as engine,
        Running(engine, options) as srv,
        aiohttp.ClientSession() as http,
    ):
        layers = len(vault.manifest.layers)
        for i in range(20):  # read the whole model in: then it is pinned for good
            if engine.debug.slots.all_resident(layers):
                break
            async for _ in engine.generate(f"warm {i}", 4, temperature=1.0, seed=i):
                pass
        assert engine.debug.slots.all_resident(layers), "the premise: the ring holds every expert"
        before = json.loads(await get(http, srv.base + "/v1/smoe/stats"))["scheduler"]
        stats = None
        async for event in engine.generate("In the beginning", 8):
            stats = event.stats or stats
        assert stats is not None and stats.hits > 0 and stats.hit_rate == 1.0
        after = json.loads(await get(http, srv.base + "/v1/smoe/stats"))["scheduler"]
        assert after["hits"] - before["hits"] == stats.hits
        assert after["misses"] - before["misses"] == stats.misses == 0
        assert after["hit_rate"] == after["hits"] / (after["hits"] + after["misses"])
        metrics = await get(http, srv.base + "/metrics")
        rate = float(re.search(r"^smoe_expert_hit_rate (\S+)$", metrics, re.M).group(1))
        assert rate == pytest.approx(after["hit_rate"], rel=1e-5)
