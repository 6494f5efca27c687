"""Routing archive recording, and the decode/prefill benchmarks on a tiny vault."""

from __future__ import annotations

import json

import numpy as np
import pytest

from smoe.bench.policy import bench_policy
from smoe.engine import Engine
from smoe.telemetry.archive import DECODE, NO_EXPERT, PREFILL, RoutingArchive
from tests.conftest import tiny_vault


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    root = tmp_path_factory.mktemp("tel")
    return tiny_vault(root, seed=5)


@pytest.mark.asyncio
async def test_archive_records_exact_routing_and_gate_order(vault, tmp_path):
    used: list[tuple[int, np.ndarray]] = []
    prompt = list(range(10, 90))  # 79 prefilled tokens: chunks of 64 and 15
    async with Engine.open(vault.path, slots=4) as engine:
        expected_logits = await engine.logits(prompt)
        engine.debug.tracer.observers.on_routing = lambda layer, idx: used.append(
            (layer, idx.copy())
        )
        engine.learning.start_recording(depth=6)
        assert np.array_equal(await engine.logits(prompt), expected_logits)  # no effect
        archive = engine.learning.stop_recording()
        engine.debug.tracer.observers.on_routing = None
    k = vault.manifest.shape.experts_per_token
    assert archive.ranks.shape == (len(prompt), len(vault.manifest.layers), 6)
    assert archive.batch.tolist() == [0] * 64 + [1] * 16
    assert set(archive.phase.tolist()) == {PREFILL}
    positions = {s.layer: i for i, s in enumerate(vault.manifest.layers)}
    offsets: dict[int, int] = {}
    for layer, idx in used:  # one call per (chunk, layer), in order
        start = offsets.get(layer, 0)
        got = archive.ranks[start : start + len(idx), positions[layer], :k]
        assert [set(r) for r in got.tolist()] == [set(r) for r in idx.tolist()]
        offsets[layer] = start + len(idx)
    # each row is a ranking: no expert twice
    assert all(len(set(r)) == 6 for r in archive.ranks.reshape(-1, 6).tolist())
    path = archive.save(tmp_path / "run")
    again = RoutingArchive.load(path)
    assert np.array_equal(again.ranks, archive.ranks) and again.top_k == k
    reqs = again.requests()
    assert len(reqs) == 2 * len(vault.manifest.layers)  # (chunk, layer) pairs


@pytest.mark.asyncio
async def test_decode_steps_are_their_own_batches(vault):
    async with Engine.open(vault.path) as engine:
        engine.learning.start_recording(depth=4)
        async for _ in engine.generate([5, 6, 7, 8], max_tokens=5, stop_at_eos=False):
            pass
        archive = engine.learning.stop_recording()
    assert archive.phase.tolist() == [PREFILL] * 3 + [DECODE] * 5
    assert archive.batch.tolist() == [0, 0, 0, 1, 2, 3, 4, 5]


@pytest.mark.asyncio
async def test_archive_records_the_lookahead_and_older_archives_still_load(vault, tmp_path):
    async with Engine.open(vault.path, slots=4) as engine:
        engine.learning.start_recording(depth=6)
        async for _ in engine.generate([5, 6, 7, 8], max_tokens=5, stop_at_eos=False):
            pass
        archive = engine.learning.stop_recording()
    assert archive.ahead is not None and archive.ahead.shape == archive.ranks.shape
    assert (archive.ahead[:, 0] == NO_EXPERT).all()  # nothing predicts the first MoE layer
    rows = archive.ahead[:, 1:].reshape(-1, 6)
    assert all(len(set(r)) == 6 and max(r) < 8 for r in rows.tolist())  # full rankings
    again = RoutingArchive.load(archive.save(tmp_path / "new"))
    assert np.array_equal(again.ahead, archive.ahead)
    # an archive written before the lookahead was recorded: exactly the old file's keys
    old = tmp_path / "old.npz"
    meta = {**archive.meta, "num_experts": 8, "top_k": archive.top_k, "format": "smoe-routing-1"}
    np.savez_compressed(
        old,
        ranks=archive.ranks,
        batch=archive.batch,
        phase=archive.phase,
        layers=np.asarray(archive.layers, np.int32),
        meta=np.array(json.dumps(meta)),
    )
    loaded = RoutingArchive.load(old)
    assert loaded.ahead is None and np.array_equal(loaded.ranks, archive.ranks)
    report = bench_policy(loaded, (0.5,), ("lru",), hint_depth=4, lookahead=True, echo=2)
    assert "not in this archive" in report["trace"]["lookahead"]
    assert set(report["rings"][0]["foresight"]) == {"lru+echo", "lfu+echo"}
    assert "lru+hint" in report["rings"][0]["policies"]


def test_bench_decode_and_prefill_report(vault, run_cli):
    code, out, err = run_cli(
        "bench", "decode", vault.path, "--budgets", "min,all", "--max-tokens", "6"
    )
    assert code == 0, err
    report = json.loads(out)
    assert report["raw_disk_GBps"] > 0 and report["compute_per_token_s"] > 0
    for row in report["runs"]:
        assert row["physical_limit_s"] == max(row["io_bound_s"], row["compute_bound_s"])
        assert row["ratio_to_limit"] > 0
        warm = row["warm_ring"]  # a second prompt on the ring the first left
        assert (
            warm["ratio_to_limit"] > 0
            and warm["ring_share_of_experts"] == (row["ring_share_of_experts"])
        )
    everything = report["runs"][-1]  # "all": the second prompt finds every expert it had
    assert everything["warm_ring"]["bytes_per_token"] <= everything["bytes_per_token"]
    code, out, err = run_cli(
        "bench", "prefill", vault.path, "--budgets", "min,all", "--lengths", "70,300",
        "--schedules", "layer,chunk",
    )  # fmt: skip
    assert code == 0, err
    runs = json.loads(out)["runs"]
    assert [(r["prompt_tokens"], r["budget"], r["schedule"]) for r in runs] == [
        (n, b, s) for n in (70, 300) for b in ("min", "all") for s in ("layer", "chunk")
    ]
    for r in runs:  # layer-major reads each layer's union once; chunk by chunk, no less
        assert r["prefill_bytes"] > 0 and r["union_bytes"] > 0
        assert (
            (r["bytes_over_union"] == 1.0 == r["max_layer_bytes_over_union"])
            if r["schedule"] == "layer"
            else r["bytes_over_union"] >= 1.0
        )
    assert any(r["bytes_over_union"] > 1.5 for r in runs if r["budget"] == "min")
    code, _, err = run_cli("bench", "prefill", vault.path, "--schedules", "rows")
    assert code != 0 and "--schedules rows" in err


def test_policy_locality_and_trace_commands(tmp_path, run_cli):
    code, out, err = run_cli(
        "bench", "trace", tmp_path / "t.npz", "--tokens", "60", "--layers", "4"
    )
    assert code == 0, err
    code, out, err = run_cli(
        "bench",
        "policy",
        str(tmp_path / "t.npz"),
        "--policies",
        "lru,lfu",
        "--json",
        str(tmp_path / "p.json"),
    )
    assert code == 0, err
    report = json.loads((tmp_path / "p.json").read_text())
    for ring in report["rings"]:
        assert ring["belady"]["misses"] <= min(p["misses"] for p in ring["policies"].values())
    code, out, err = run_cli("bench", "locality", tmp_path / "t.npz")
    assert code == 0, err
    assert "overlap" in json.loads(out)["headline"]
