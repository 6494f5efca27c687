"""The async tests run on both event loops: asyncio's own and uvloop (conftest.py). Each
check stands alone, so the file passes in any test order."""

from __future__ import annotations

import asyncio

import pytest


@pytest.mark.asyncio
async def test_runs_on_each_loop(request):
    """Each instance runs on the loop its id names."""
    loop_name = request.node.callspec.id.split("-")[0]
    assert loop_name in ("asyncio", "uvloop")
    assert type(asyncio.get_running_loop()).__module__.split(".")[0] == loop_name


def test_the_loop_factories_are_asyncio_and_uvloop(request):
    from tests.conftest import pytest_asyncio_loop_factories

    factories = pytest_asyncio_loop_factories(request.config, request.node)
    assert sorted(factories) == ["asyncio", "uvloop"]
    loop = factories["uvloop"]()
    try:
        assert type(loop).__module__.split(".")[0] == "uvloop"
    finally:
        loop.close()
