"""`smoe bench resident` on the tiny vault: the engine and mlx-lm give the same tokens, and
each run reports what it built ahead itself (the runner's counter spans both runs)."""

import pytest

from smoe.bench.resident import bench_resident
from tests.conftest import tiny_vault

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    return tiny_vault(tmp_path_factory.mktemp("bench-resident"), seed=4)


async def test_bench_resident_reports_one_runs_passes_built_ahead(vault):
    out = await bench_resident(str(vault.path), prompt_tokens=12, max_tokens=8, chunk=4)
    assert out["tokens_equal"] and out["first_different_token"] is None
    # 8 tokens: every decode pass but the first is queued while the token before it is
    # read back. One run's count (7), not both runs' (14), whichever run was the faster.
    assert out["engine"]["built_ahead"] == 7
    assert out["engine"]["bytes_read"] == 0
