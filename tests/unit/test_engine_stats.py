"""``Engine.stats()``: one typed record that the CLI, the REPL and the server all read, so
their figures agree; a snapshot that follows the scheduler's counters."""

import json

import pytest

from smoe.engine import Engine
from smoe.engine.stats import EngineStats
from tests.conftest import tiny_vault

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    return tiny_vault(tmp_path_factory.mktemp("engine-stats"), seed=6)


async def test_stats_is_one_snapshot_of_the_scheduler_ring_and_batch(vault):
    async with Engine.open(vault.path, slots=8, max_batch=2) as engine:
        before = engine.stats()
        assert isinstance(before, EngineStats)
        assert before.ring.slots == 8 and before.ring.filled == 0
        assert before.ring.nbytes == 8 * before.ring.slot_bytes
        assert before.batch.max_batch == 2 and before.batch.active == 0
        assert before.compute_dtype == "float32" and before.draft is None
        async for _ in engine.generate([3, 4, 5, 6], max_tokens=4, stop_at_eos=False):
            pass
        after = engine.stats()
        read = after.scheduler.bytes_read()
        assert read > 0 and after.ring.filled > 0
        assert after.scheduler.hits + after.scheduler.misses > 0
        assert json.loads(json.dumps(after.to_json()))["ring"]["slots"] == 8


async def test_the_repl_and_the_cli_report_the_engines_figures(vault):
    from smoe.chat.repl import ChatApp

    async with Engine.open(vault.path, slots=8, max_batch=1) as engine:
        app = ChatApp(engine, engine.conversation())
        now = engine.stats()
        assert f"ring {now.ring.filled}/{now.ring.slots}" in app.status()
        assert f"compute: {now.compute_dtype_note}" in app.stats_text()
