"""The async tests run on both event loops: asyncio's own and uvloop (conftest.py)."""

from __future__ import annotations

import asyncio

import pytest

SEEN: set[str] = set()


@pytest.mark.asyncio
async def test_runs_on_each_loop():
    SEEN.add(type(asyncio.get_running_loop()).__module__.split(".")[0])


def test_both_loops_were_used():
    assert {"asyncio", "uvloop"} == SEEN
