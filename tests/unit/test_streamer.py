"""The real streaming stack: scheduler + direct-I/O reader + ring, on a converted vault."""

from __future__ import annotations

import json
import random

import mlx.core as mx
import pytest

from smoe.io import DirectReader
from smoe.io import UnifiedRing as Ring
from smoe.sched.scheduler import ExpertScheduler
from smoe.vault.convert import ConvertOptions, convert
from smoe.vault.export import read_layer


@pytest.fixture(scope="module")
def vault(hf_dir, tmp_path_factory):
    return convert(
        hf_dir("qwen3_moe"), tmp_path_factory.mktemp("v") / "v", ConvertOptions(dtype="float32")
    )


@pytest.mark.asyncio
async def test_slots_hold_exactly_the_records_asked_for(vault):
    m = vault.manifest
    ring = Ring(m.record, 5)
    views = ring.views()
    expected = {s.layer: read_layer(vault, s.layer) for s in m.layers}
    with DirectReader(vault, ring, workers=3) as reader:
        sched = ExpertScheduler(
            ring.num_slots,
            reader,
            record_of=lambda k: m.record_index(*k),
            record_bytes=m.record.stride,
            workers=3,
        )
        rng = random.Random(0)
        for _ in range(40):
            layer = rng.choice([s.layer for s in m.layers])
            experts = rng.sample(range(m.num_experts), rng.randint(1, 4))
            if rng.random() < 0.5:
                sched.prefetch(layer, [rng.randrange(m.num_experts)])
            slots = await sched.acquire(layer, experts)
            for e, s in zip(experts, slots, strict=True):
                for name, view in views.items():
                    assert mx.array_equal(view[s, ...], expected[layer][name][e]), (layer, e, name)
            sched.release(slots)
            sched.check_invariants()
        await sched.close()
    assert sched.stats.hits > 0 and sched.stats.misses > 0
    assert sched.stats.io_errors == 0


def test_bench_io_reports_both_sides(vault, run_cli):
    code, out, _ = run_cli(
        "bench",
        "io",
        vault.path,
        "--workers",
        "1,2",
        "--repeats",
        "2",
        "--slots",
        "8",
        "--batch",
        "4",
    )
    assert code == 0
    report = json.loads(out)
    assert [r["workers"] for r in report["sweep"]] == [1, 2]
    for row in report["sweep"]:
        assert row["baseline_GBps"] > 0 and row["streamer_GBps"] > 0
        assert len(row["baseline_runs_GBps"]) == len(row["streamer_runs_GBps"]) == 2
    assert report["records_per_run"] == vault.manifest.num_records
    assert report["verify"] is True
    assert report["checksum_algorithm"] == vault.manifest.checksum_algorithm

    # --no-verify: only to measure what checking costs (the engine always checks)
    code, out, _ = run_cli(
        "bench", "io", vault.path, "--workers", "1", "--repeats", "1", "--no-verify"
    )
    assert code == 0 and json.loads(out)["verify"] is False
    assert [row["verify"] for row in json.loads(out)["sweep"]] == [False]

    # --control: a second baseline per repeat gives the A/A ratio, the noise floor
    code, out, _ = run_cli(
        "bench", "io", vault.path, "--workers", "1", "--repeats", "2", "--control"
    )
    row = json.loads(out)["sweep"][0]
    assert code == 0 and row["control_GBps"] > 0
    assert len(row["control_ratio_runs"]) == len(row["ratio_runs"]) == 2
    # the GB/s figures are rounded to 3 decimals, which on a tiny vault is a few percent
    c, b = row["control_GBps"], row["baseline_GBps"]
    assert row["control_ratio"] == pytest.approx(c / b, rel=0.02 + 0.0005 / c + 0.0005 / b)


def test_ring_asks_for_huge_pages(vault, monkeypatch):
    """The ring asks the kernel for huge pages over all of its memory, and reports what the
    kernel answered. (Whether the kernel grants a collapse depends on its free memory at
    that moment: under load it may refuse, so the kernel's side is faked here.)"""
    import smoe.io.unified as unified

    asked = []
    for granted in (True, False):
        monkeypatch.setattr(
            unified, "advise_huge_pages", lambda a, n, g=granted: asked.append((a, n)) or g
        )
        ring = Ring(vault.manifest.record, 400)  # ~6.5 MB: holds whole 2 MiB pages
        assert ring.huge_pages is granted
        assert asked[-1][1] == ring.allocated_bytes  # the whole allocation was advised
        view = ring.views()["gate_proj.weight"]
        assert view.shape[0] == 400  # the views still work on the advised memory


def test_bench_io_runs_the_staged_path_through_its_commit_thread(vault, run_cli):
    """The staged ring is built and committed on its own thread, as the engine's compute
    thread does; every record lands and is counted."""
    code, out, err = run_cli(
        "bench", "io", vault.path, "--workers", "2", "--repeats", "1", "--path", "staged"
    )
    assert code == 0, err
    (row,) = json.loads(out)["sweep"]
    assert row["path"] == "staged" and row["streamer_GBps"] > 0
