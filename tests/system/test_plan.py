"""`smoe plan`: the fit the engine will make, on a vault and on a source folder, the probes
and their caches, and the forecast's model."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import numpy as np
import pytest

from smoe.engine import Engine
from smoe.forecast.speed import (
    Shape,
    chunk_union,
    forecast,
    hit_rates,
    prediction_band,
    routing_probabilities,
    serial_read_s,
)
from smoe.io.disk_probe import probe_disk
from smoe.plan.ring import budget_parts, current_device, ring_kind, slot_bytes
from smoe.util.loop import run
from smoe.vault.convert import ConvertOptions, convert
from smoe.vault.source import open_model
from tests.conftest import make_hf_checkpoint, tiny_vault
from tests.unit.test_budget import default_context


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """The disk probe's cache in this test's own directory."""
    monkeypatch.setenv("SMOE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    return tiny_vault(tmp_path_factory.mktemp("plan"), seed=23)


def _plan(run_cli, *args, exit_code: int = 0):
    code, out, err = run_cli("plan", *args, "--json", "--probe-seconds", "0.3")
    assert code == exit_code, err
    return json.loads(out)


async def _engine_fit(vault, memory):
    async with Engine.open(vault.path, memory=memory, max_batch=1, device="cpu") as engine:
        assert engine.plan.ring.fit is not None
        return engine.plan.ring.fit.to_json()


def test_plan_and_engine_pick_the_same_default_context(vault, run_cli):
    """A budget too small for the default 4096-token context: `smoe plan` and the engine
    both budget the largest half that fits (budget.pick_context), the same fit."""
    m = vault.manifest
    needs = budget_parts(vault, mx.float32, kind="unified", max_batch=1, max_context=1024)
    memory = needs.fixed + m.shape.experts_per_token * m.record.stride
    plan = _plan(run_cli, vault.path, "--memory", str(memory), "--device", "cpu")
    assert plan["fits"] is True and plan["fit"]["context"] == 1024
    assert run(_engine_fit(vault, memory)) == plan["fit"]
    asked = _plan(run_cli, vault.path, "--memory", str(memory), "--max-context", "1024")
    assert asked["fit"] == plan["fit"]  # --max-context, as the run commands call it


def test_plan_on_a_vault_is_the_fit_the_engine_makes(vault, run_cli):
    m = vault.manifest
    needs = budget_parts(
        vault, mx.float32, kind="unified", max_batch=1, max_context=default_context(vault)
    )
    memory = needs.fixed + 6 * m.record.stride
    code, out, err = run_cli(
        "plan",
        vault.path,
        "--memory",
        str(memory),
        "--device",
        "cpu",
        "--json",
        "--probe-seconds",
        "0.3",
    )
    assert code == 0 and "measuring compute on this cpu" in err  # said before the probe
    plan = json.loads(out)
    assert plan["kind"] == "vault" and plan["fits"] is True
    assert plan["fit"]["ring_slots"] == 6
    smallest = budget_parts(vault, mx.float32, kind="unified", max_batch=1, max_context=512)
    assert plan["smallest_memory_context"] == 512  # the least the default context halves to
    assert (
        plan["smallest_memory_bytes"]
        == smallest.fixed + m.shape.experts_per_token * m.record.stride
    )
    assert run(_engine_fit(vault, memory)) == plan["fit"]
    f = plan["forecast"]
    for key in ("decode_tok_s", "prefill_tok_s", "hit_rate", "reads_per_token", "cold_fill_s"):
        low, high = f[key]
        assert 0 <= low <= high, key
    assert plan["compute"]["slots"] == 6 and len(plan["compute"]["decode_s"]) >= 3
    assert plan["routing"].startswith(("vault popularity", "published locality"))
    assert plan["context_limit"] == plan["fit"]["context"]  # the model's max fits here
    # the second plan reuses the recorded compute and the cached disk probe
    again = _plan(run_cli, vault.path, "--memory", str(memory), "--device", "cpu")
    assert again["compute"]["recorded"] is True and again["disk"]["cached"] is True
    _, table, err = run_cli("plan", vault.path, "--memory", str(memory), "--device", "cpu")
    assert "measuring compute" not in err  # recorded: nothing to wait for
    assert " GB/s (low " in table  # the disk's figures, labelled
    assert again["compute"]["decode_s"] == plan["compute"]["decode_s"]


def test_plan_names_the_smallest_budget_when_it_does_not_fit(vault, run_cli):
    plan = _plan(run_cli, vault.path, "--memory", "50MB", "--no-compute", exit_code=1)
    assert plan["fits"] is False and plan["fit"] is None
    assert f"--memory {plan['smallest_memory']}" in plan["why"]
    assert plan["context_limit"] == 0  # not even a 256-token cache fits
    code, out, _ = run_cli("plan", vault.path, "--memory", "50MB", "--no-compute")
    assert code == 1 and f"does not fit: smallest budget {plan['smallest_memory']}" in out


def test_ctrl_c_during_the_compute_probe_is_one_line_and_exit_130(vault):
    """The probe says what it runs and how long, and SIGINT (Ctrl-C) once it has begun
    ends the plan with one line, no traceback and no plan."""
    import signal
    import subprocess
    import sys

    argv = [sys.executable, "-m", "smoe.cli", "plan", str(vault.path), "--fresh"]
    argv += ["--probe-seconds", "0.3", "--device", "cpu"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    said = []
    for line in proc.stderr:  # the line comes before the probe starts: nothing to wait on
        said.append(line)
        if "measuring compute" in line:
            proc.send_signal(signal.SIGINT)
            break
    out, rest = proc.communicate()
    assert said and "a warm-up request, then 4, each a 129-token prompt" in said[-1]
    assert "Ctrl-C stops it" in said[-1]
    lines = [line for line in rest.splitlines() if line.strip()]
    assert proc.returncode == 130 and lines[-1] == "smoe plan: interrupted", rest
    assert "Traceback" not in rest and out == ""


def test_the_probe_estimates_its_time_after_the_warm_up(vault, run_cli):
    code, _, err = run_cli("plan", vault.path, "--fresh", "--probe-seconds", "0.3")
    assert code == 0, err
    assert re.search(r"the warm-up request took [\d.]+ s: about \d+ s more for the 4", err)


def test_the_smallest_budget_does_not_depend_on_memory(vault, run_cli):
    """The default context halves to fit --memory; the smallest budget and the one for
    every expert are named at fixed contexts, so every --memory gives the same figures."""
    m = vault.manifest
    parts = [
        budget_parts(vault, mx.float32, kind="unified", max_batch=1, max_context=c)
        for c in (default_context(vault), 512)
    ]
    top_k = m.shape.experts_per_token * m.record.stride
    between = (parts[0].fixed + parts[1].fixed) // 2 + top_k  # fits a shorter context only
    plans = [
        _plan(run_cli, vault.path, "--no-compute", "--memory", str(memory), "--device", "cpu")
        for memory in ("2GB", between)
    ]
    assert plans[0]["fit"]["context"] > plans[1]["fit"]["context"]  # the budgets differ
    for key in ("smallest_memory_bytes", "smallest_memory", "memory_for_every_expert"):
        assert plans[0][key] == plans[1][key], key
    assert plans[0]["smallest_memory_bytes"] == parts[1].fixed + top_k
    assert plans[0]["every_expert_context"] == default_context(vault)


def test_a_shorter_context_and_quantized_kv_lower_the_smallest_budget(
    vault, tmp_path_factory, run_cli
):
    full = _plan(run_cli, vault.path, "--no-compute", "--memory", "2GB", "--context", "1024")
    short = _plan(run_cli, vault.path, "--no-compute", "--memory", "2GB", "--context", "512")
    assert short["smallest_memory_bytes"] < full["smallest_memory_bytes"]
    assert short["fit"]["context"] == 512 and full["smallest_memory_context"] == 1024
    # heads 64 wide (the tiny vault's 16 cannot be quantized: refused in one line)
    root = tmp_path_factory.mktemp("wide")
    src = make_hf_checkpoint(root / "src", "qwen3_moe", seed=4, head_dim=64)
    wide = convert(src, root / "v", ConvertOptions(dtype="float32")).path
    plain = _plan(run_cli, wide, "--no-compute", "--memory", "2GB")
    q8 = _plan(run_cli, wide, "--no-compute", "--memory", "2GB", "--kv-bits", "8")
    q4 = _plan(run_cli, wide, "--no-compute", "--memory", "2GB", "--kv-bits", "4")
    assert q8["fit"]["kv_bits"] == 8 and q4["fit"]["kv_bits"] == 4
    # float32 K/V against a byte (or half) per element plus a float32 scale and bias per 64
    assert q8["fit"]["kv_bytes"] * 4 == plain["fit"]["kv_bytes"] * (1 + 8 / 64)
    assert q4["fit"]["kv_bytes"] * 4 == plain["fit"]["kv_bytes"] * (0.5 + 8 / 64)
    assert q8["smallest_memory_bytes"] < plain["smallest_memory_bytes"]
    code, out, err = run_cli("plan", vault.path, "--no-compute", "--kv-bits", "8")
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "multiple of 32; this model's are 16 wide: leave --kv-bits out" in err


async def _engine_ring(path, memory):
    """What the engine opens on ``path`` with ``memory`` (None: its default): the ring's
    slots, its context and its fit."""
    async with Engine.open(path, memory=memory, max_batch=1, device="cpu") as engine:
        fit = engine.plan.ring.fit.to_json() if engine.plan.ring.fit is not None else None
        return engine.stats().ring.slots, engine.max_context, fit


@pytest.mark.parametrize("what", ["vault", "download"])
@pytest.mark.parametrize("memory", [None, "fixed+7"])
def test_plan_and_the_run_make_one_ring_on_a_vault_and_a_download(
    what, memory, vault, hf_dir, run_cli
):
    """`smoe plan X` and `smoe generate X` agree on the ring, the context and the budget,
    with and without --memory, on a vault and on a download run as it is (one planning
    call: smoe.plan.plan.plan)."""
    path = vault.path if what == "vault" else hf_dir("qwen3_moe")
    opened = open_model(path)
    records = opened.manifest.num_records
    if memory is not None:  # 7 slots beside what the engine budgets at 4096 tokens
        layout, cpu = opened.manifest.record, current_device(mx.cpu)
        kind = ring_kind("auto", layout, mx.float32, cpu)
        needs = budget_parts(opened, mx.float32, kind=kind, max_batch=1, max_context=4096)
        memory = str(needs.fixed + 7 * slot_bytes(kind, layout, mx.float32))
    args = ("--memory", memory) if memory is not None else ()
    plan = _plan(run_cli, path, *args, "--device", "cpu", "--no-compute")
    slots, context, fit = run(_engine_ring(path, memory))
    assert plan["kind"] == ("vault" if what == "vault" else "source")
    assert plan["fits"] is True and plan["fit"]["ring_slots"] == slots
    assert plan["fit"]["context"] == context
    if memory is not None:
        assert slots == 7 < records and plan["fit"] == fit  # backbone, KV, working, ring


def test_the_engine_and_smoe_plan_make_one_planning_call(vault, monkeypatch):
    """Where the ring is sized is one function (issue 29): Engine.open and `smoe plan`
    both call smoe.plan.plan.assess (the engine through plan, which refuses what does not
    fit), with the same options, and get the same Plan."""
    import smoe.engine.core as core
    import smoe.forecast.planner as planner
    import smoe.plan.plan as plan_module

    made = []

    def spy(model, options, workers, batchable=False):
        made.append(plan_module.assess(model, options, workers, batchable))
        return made[-1]

    monkeypatch.setattr(core, "plan_engine", spy)
    monkeypatch.setattr(planner, "assess", spy)
    memory = "1GB"

    async def both():
        opts = planner.PlanOptions(memory=memory, device="cpu", workers=4, compute=False)
        out = await planner.make_plan(vault.path, opts)
        async with Engine.open(
            vault.path, memory=memory, device="cpu", max_batch=1, workers=4
        ) as engine:
            return out, engine.stats().ring.slots

    out, slots = run(both())
    assert len(made) == 2 and made[0] == made[1]
    assert made[0].ring.slots == slots == out["fit"]["ring_slots"]


def test_plan_on_a_download_sizes_what_the_run_reads(hf_dir, run_cli):
    """Without --bits a download is planned as it runs (its own float records), with
    --bits as `smoe convert` would make it: the records differ, each side says which."""
    src = hf_dir("qwen3_moe")
    as_is = _plan(run_cli, src, "--memory", "2GB", "--device", "cpu", "--no-compute")
    four = _plan(run_cli, src, "--memory", "2GB", "--device", "cpu", "--bits", "4")
    assert as_is["kind"] == "source" and four["kind"] == "converted"
    assert as_is["experts"]["record_bytes"] > four["experts"]["record_bytes"]
    _, table, _ = run_cli("plan", src, "--memory", "2GB", "--device", "cpu", "--no-compute")
    assert "(source, run as it is)" in table


def test_plan_on_a_source_folder_reads_headers_only(hf_dir, tmp_path, run_cli):
    """A HF checkpoint with --bits: the record and backbone `convert` would make (checked
    against the vault it then makes), no speed without a vault to measure compute on."""
    src = hf_dir("qwen3_moe")
    plan = _plan(run_cli, src, "--memory", "2GB", "--device", "cpu", "--bits", "4")
    assert plan["kind"] == "converted" and plan["compute"] is None
    assert "convert the model first" in plan["why_no_speed"]
    made = convert(src, tmp_path / "v", ConvertOptions(bits=4))
    m = made.manifest
    assert plan["experts"]["record_bytes"] == m.record.stride
    assert plan["experts"]["records"] == m.num_records
    vault_plan = _plan(run_cli, made.path, "--memory", "2GB", "--device", "cpu", "--no-compute")
    assert plan["fit"] == vault_plan["fit"]  # backbone, KV, working and ring alike
    assert plan["disk"]["gbps"] > 0


def test_the_disk_probe_is_cached_per_device_stride_and_workers(vault, tmp_path):
    cache = tmp_path / "probe.json"
    stride = vault.manifest.record.stride
    first = probe_disk(vault.experts_path, stride, 2, seconds=0.2, cache=cache)
    assert first["cached"] is False and 0 < first["gbps_low"] <= first["gbps_high"]
    again = probe_disk(vault.experts_path, stride, 2, seconds=0.2, cache=cache)
    assert again["cached"] is True and again["gbps"] == first["gbps"]
    other = probe_disk(vault.experts_path, stride, 1, seconds=0.2, cache=cache)
    assert other["cached"] is False  # another worker count is another measurement
    fresh = probe_disk(vault.experts_path, stride, 2, seconds=0.2, cache=cache, fresh=True)
    assert fresh["cached"] is False
    assert len(json.loads(cache.read_text())) == 2
    cache.write_text("{not json")  # a damaged cache is measured afresh, not an error
    assert probe_disk(vault.experts_path, stride, 2, seconds=0.2, cache=cache)["cached"] is False


def test_hit_rates_grow_with_the_ring_and_follow_popularity():
    shape = Shape(layers=2, experts=8, top_k=2, record_bytes=1000)
    counts = np.array([[8, 4, 2, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], float)
    q, source = routing_probabilities(shape, counts)
    assert source.startswith("vault popularity") and np.allclose(q.sum(1), 2)
    # the 3 likeliest experts: 2*8/16, 2*4/16 of layer 0 and one 2/8 of layer 1 (of 4 picks)
    assert hit_rates(shape, q, 3)[0] == pytest.approx((1 + 0.5 + 0.25) / 4)
    lows = [hit_rates(shape, q, s)[0] for s in range(2, 17)]
    assert lows == sorted(lows) and hit_rates(shape, q, 16) == (1.0, 1.0)
    published, source = routing_probabilities(shape, None)
    assert source.startswith("published locality") and np.allclose(published.sum(1), 2)
    # a chunk's union: 64 tokens route to nearly every expert a uniform layer has
    assert chunk_union(np.full((1, 8), 0.25), 64) == pytest.approx(8 * (1 - 0.75**64))


def test_the_decode_band_orders_and_bounds_its_parts():
    shape = Shape(layers=2, experts=8, top_k=2, record_bytes=10**6)
    q, _ = routing_probabilities(shape, None)
    disk = {"gbps_low": 1.0, "gbps": 1.5, "gbps_high": 2.0}
    compute = {"decode_s": [0.010, 0.011, 0.012], "prefill_token_s": [0.001, 0.002]}
    c_lo, c_hi = prediction_band(compute["decode_s"])
    f = forecast(shape, 4, q, disk, compute)
    low, high = f["decode_tok_s"]
    reads_lo, reads_hi = f["reads_per_token"]
    assert high == pytest.approx(1 / max(c_lo, reads_lo * 1e6 / 2e9), rel=1e-3)
    # slow: each layer's reads (< 4 here) wait one round of 4 in flight: 4 MB at 1 GB/s
    assert reads_hi / 2 < 4
    assert low == pytest.approx(1 / (c_hi + 2 * 4 * 1e6 / 1e9), rel=1e-3)
    every = forecast(shape, 16, q, disk, compute)  # every expert resident: compute alone
    assert every["reads_per_token"] == [0.0, 0.0]
    assert every["decode_tok_s"] == [round(1 / c_hi, 3), round(1 / c_lo, 3)]
    assert every["cold_fill_s"] == [round(16e6 / 2e9, 4), round(16e6 / 1e9, 4)]


def test_the_probes_measured_hit_rates_widen_the_band():
    """A decode that repeats itself (a random-weight model's greedy loop: 99.5% hits at half
    the experts on the H200, docs/performance.md) beats the popularity curve; the probe
    measured it at this ring, so the band takes it in, and only ever widens."""
    shape = Shape(layers=2, experts=8, top_k=2, record_bytes=10**8)  # reads dominate
    q, _ = routing_probabilities(shape, None)
    disk = {"gbps_low": 1.0, "gbps": 1.5, "gbps_high": 2.0}
    compute = {"decode_s": [0.010, 0.011, 0.012], "prefill_token_s": [0.001, 0.002]}
    modelled = forecast(shape, 8, q, disk, compute)
    looping = forecast(shape, 8, q, disk, compute | {"decode_hit_rate": [0.99, 1.0]})
    assert modelled["hit_rate"][1] < 0.99 and looping["hit_rate"][1] == 1.0
    assert looping["hit_rate"][0] == modelled["hit_rate"][0]  # a min above the model's
    assert looping["decode_tok_s"][1] > modelled["decode_tok_s"][1]
    assert looping["decode_tok_s"][0] == modelled["decode_tok_s"][0]
    one = forecast(shape, 8, q, disk, compute, workers=1)  # reads one at a time
    cold = forecast(shape, 8, q, disk, compute | {"decode_hit_rate": [0.1]}, workers=1)
    assert cold["hit_rate"][0] == 0.1 and cold["decode_tok_s"][0] < one["decode_tok_s"][0]
    # measured reads per token (misses and lookahead guesses) widen the reads band alike
    few = forecast(shape, 8, q, disk, compute | {"decode_reads_per_token": [0.05, 0.2]})
    assert few["reads_per_token"] == [0.05, modelled["reads_per_token"][1]]
    c_lo, _ = prediction_band(compute["decode_s"])
    assert few["decode_tok_s"][1] == round(1 / max(c_lo, 0.05 * 1e8 / 2e9), 3)
    # and records read per prefill chunk widen the prefill band
    union = modelled["prefill_chunk_experts"]
    fewer = forecast(shape, 8, q, disk, compute | {"prefill_reads_per_chunk": [1.0]})
    assert fewer["prefill_tok_s"][1] > modelled["prefill_tok_s"][1] and union - 8 > 1.0
    assert fewer["prefill_tok_s"][0] == modelled["prefill_tok_s"][0]


def test_the_compute_band_is_a_95_percent_prediction_interval():
    """Against scipy's t distribution, on the logarithms (timing noise is multiplicative):
    exp(mean +- t(n-1) sd sqrt(1 + 1/n)), at least the range."""
    from scipy import stats

    rng = np.random.default_rng(0)
    for n in (2, 3, 5, 8, 10):
        values = list(rng.lognormal(np.log(10.0), 0.1, n))
        logs = np.log(values)
        mean, sd = np.mean(logs), np.std(logs, ddof=1)
        half = stats.t.ppf(0.975, n - 1) * sd * np.sqrt(1 + 1 / n)
        low, high = prediction_band(values)
        if n > 2:  # (two samples' t of 12.7 goes past the factor-2 cap)
            assert low == pytest.approx(min(min(values), np.exp(mean - half)), rel=2e-3)
            assert high == pytest.approx(max(max(values), np.exp(mean + half)), rel=2e-3)
        assert min(values) / 2 <= low <= min(values) and max(values) <= high <= 2 * max(values)
    assert prediction_band([3.0]) == (3.0, 3.0)
    # a new draw from the same distribution falls inside about 95% of the time
    inside = 0
    for _ in range(2000):
        sample = rng.lognormal(np.log(5.0), 0.2, 8)
        low, high = prediction_band(list(sample))
        inside += low <= rng.lognormal(np.log(5.0), 0.2) <= high
    assert 0.93 < inside / 2000 < 0.985


def test_noisy_compute_samples_never_give_an_unbounded_speed():
    """Three noisy probe samples (as a busy 2-core machine gives): the old band in seconds
    reached 0, and the decode band's top 1e9 tok/s (`smoe plan` on the demo)."""
    low, high = prediction_band([0.002, 0.03, 0.004])
    assert low == 0.001 and high == 0.06  # the samples' range, widened by at most 2x


def test_a_layer_waits_for_its_reads_in_rounds_of_the_workers():
    assert serial_read_s(0, 2, 4, 10**6, 1e9) == 0
    assert serial_read_s(8, 2, 4, 10**6, 1e9) == pytest.approx(2 * 1 * 4e-3)  # 4 per layer
    assert serial_read_s(9, 2, 4, 10**6, 1e9) == pytest.approx(2 * 2 * 4e-3)  # 4.5: 2 rounds
    assert serial_read_s(8, 2, 1, 10**6, 1e9) == pytest.approx(8e-3)  # one at a time


def test_plan_refuses_bad_options_in_one_line(vault, run_cli):
    code, _, err = run_cli("plan", vault.path, "--bits", "4")
    assert code == 1 and "--bits is for a source folder" in err and "Traceback" not in err
    code, _, err = run_cli("plan", vault.path / "nope")
    assert code == 1 and "Traceback" not in err
