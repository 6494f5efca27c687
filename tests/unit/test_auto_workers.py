"""--workers auto: the I/O thread count chosen for the disk (smoe.io.disk_probe)."""

from __future__ import annotations

import argparse
import json

import pytest

import smoe.io.disk_probe as probe
from smoe.commands.options import worker_count
from smoe.engine import Engine
from smoe.io.disk_probe import (
    AUTO_PROBE_MIN_BYTES,
    DEFAULT_WORKERS,
    auto_workers,
    choose_workers,
    probe_workers,
)
from tests.conftest import tiny_vault


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """The disk probe's cache in this test's own directory."""
    monkeypatch.setenv("SMOE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    return tiny_vault(tmp_path_factory.mktemp("auto-workers"), seed=31)


def fake_disk(monkeypatch, rates: dict[int, float], cached: bool = False) -> list[int]:
    """probe_disk answering ``rates`` by worker count; returns the counts it was asked."""
    asked: list[int] = []

    def measured(path, stride, workers, **kw):
        asked.append(workers)
        return {"gbps_low": rates[workers], "gbps": rates[workers], "gbps_high": rates[workers]}

    monkeypatch.setattr(
        probe, "probe_disk", lambda *a, **kw: measured(*a, **kw) | {"cached": cached}
    )
    return asked


def test_the_fewest_workers_within_five_percent_of_the_best_are_chosen():
    assert choose_workers({1: 1.0, 2: 1.92, 4: 2.0, 8: 2.01}) == 2  # 1.92 >= 0.95 x 2.01
    assert choose_workers({1: 1.0, 2: 1.5, 4: 2.0, 8: 2.3}) == 8
    assert choose_workers({1: 3.0, 2: 2.0}) == 1  # more threads that lose: the fewest
    assert choose_workers({4: 2.0}) == 4


def test_the_probe_stops_once_two_counts_in_a_row_gain_nothing(monkeypatch, tmp_path):
    asked = fake_disk(monkeypatch, {1: 1.0, 2: 1.8, 4: 2.0, 8: 2.02, 16: 2.5})
    found = probe_workers(tmp_path, 4096)
    assert asked == [1, 2, 4, 8, 16]  # 4 gains 11%: 8 and 16 are still tried
    assert found["workers"] == 16 and found["cached"] is False
    asked = fake_disk(monkeypatch, {1: 1.0, 2: 2.0, 4: 2.02, 8: 2.03, 16: 9.0}, cached=True)
    found = probe_workers(tmp_path, 4096)
    assert asked == [1, 2, 4, 8]  # 4 and 8 gained under 5%: 16 is never read
    assert found == {"workers": 2, "gbps": {1: 1.0, 2: 2.0, 4: 2.02, 8: 2.03}, "cached": True}


def test_a_small_model_or_an_unreadable_disk_gets_the_default(monkeypatch, tmp_path):
    asked = fake_disk(monkeypatch, {w: 1.0 for w in (1, 2, 4, 8, 16)})
    assert auto_workers(tmp_path, 4096, AUTO_PROBE_MIN_BYTES - 1) == (DEFAULT_WORKERS, None)
    assert asked == []  # not probed

    def unreadable(*a, **kw):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(probe, "probe_disk", unreadable)
    workers, line = auto_workers(tmp_path, 4096, AUTO_PROBE_MIN_BYTES)
    assert workers == DEFAULT_WORKERS and line is not None and "Permission denied" in line


def test_a_large_model_gets_the_probed_count_and_one_line(monkeypatch, tmp_path):
    fake_disk(monkeypatch, {1: 0.5, 2: 1.0, 4: 1.9, 8: 2.0, 16: 2.0})
    workers, line = auto_workers(tmp_path, 4096, AUTO_PROBE_MIN_BYTES)
    assert workers == 4
    assert (
        line
        == "4 I/O workers (disk GB/s by workers, measured: 1: 0.50, 2: 1.00, 4: 1.90, 8: 2.00, 16: 2.00)"
    )


def test_the_real_probe_reads_the_file_and_caches_each_count(vault, tmp_path):
    cache = tmp_path / "probe.json"
    stride = vault.manifest.record.stride
    found = probe_workers(vault.experts_path, stride, candidates=(1, 2), seconds=0.1, cache=cache)
    assert found["workers"] in (1, 2) and set(found["gbps"]) == {1, 2}
    assert all(g > 0 for g in found["gbps"].values()) and found["cached"] is False
    again = probe_workers(vault.experts_path, stride, candidates=(1, 2), seconds=0.1, cache=cache)
    assert again == found | {"cached": True}
    assert len(json.loads(cache.read_text())) == 2


def test_a_damaged_cache_entry_is_measured_afresh(vault, tmp_path):
    cache = tmp_path / "probe.json"
    stride = vault.manifest.record.stride
    key = probe.disk_key(vault.experts_path, stride, 1)
    for bad in (
        {"gbps_low": 1, "gbps": "fast", "gbps_high": 2},
        {"gbps_low": 0, "gbps": 0, "gbps_high": 0},
        [1],
    ):
        cache.write_text(json.dumps({key: bad}))
        r = probe.probe_disk(vault.experts_path, stride, 1, seconds=0.1, rounds=1, cache=cache)
        assert r["cached"] is False and r["gbps"] > 0


@pytest.mark.asyncio
async def test_an_engine_opened_with_auto_workers_reads_with_the_disks_count(vault, monkeypatch):
    async with Engine.open(vault.path, device="cpu") as engine:  # a small model: not probed
        assert engine.debug.reader.workers == DEFAULT_WORKERS and engine.start_lines == []
    monkeypatch.setattr(probe, "AUTO_PROBE_MIN_BYTES", 1)
    fake_disk(monkeypatch, {1: 1.0, 2: 1.99, 4: 2.0, 8: 2.0, 16: 2.0})
    async with Engine.open(vault.path, device="cpu") as engine:
        assert engine.debug.reader.workers == 2
        assert [line[:13] for line in engine.start_lines] == ["2 I/O workers"]
    async with Engine.open(vault.path, device="cpu", workers=3) as engine:  # asked: kept
        assert engine.debug.reader.workers == 3 and engine.start_lines == []


def test_the_workers_option_takes_auto_or_a_number():
    assert worker_count("auto") is None and worker_count("8") == 8 and worker_count("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match="give auto or a number"):
        worker_count("many")  # a count below 1: EngineOptions' one line (test_engine_api)
