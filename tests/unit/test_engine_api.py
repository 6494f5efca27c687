"""The async Engine API and `smoe generate`: events, stats, cancellation, bad input."""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import pytest

from smoe.compute.worker import RESIDENT
from smoe.engine import Engine
from smoe.errors import SmoeError, VaultError
from smoe.synth import synthesize
from smoe.vault.convert import ConvertOptions, convert
from tests.conftest import edit_json


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    src = synthesize(root / "src", arch="qwen3_moe", preset="tiny", seed=7)
    return convert(src, root / "v", ConvertOptions(dtype="float32"))


async def collect(engine, prompt, **kw):
    tokens, text, last = [], [], None
    async for ev in engine.generate(prompt, **kw):
        if ev.token is not None:
            tokens.append(ev.token)
        text.append(ev.text)
        last = ev
    return tokens, "".join(text), last


@pytest.mark.asyncio
async def test_generate_events_and_stats(vault):
    # Without lookahead every byte read is a miss: the accounting below is exact.
    async with Engine.open(vault.path, lookahead=False) as engine:
        tokens, text, last = await collect(
            engine, "Once upon a time", max_tokens=12, stop_at_eos=False
        )
        assert len(tokens) == 12 and text
        assert last.finish_reason == "length"
        s = last.stats
        assert s.generated_tokens == 12 and s.prompt_tokens == len(
            engine.encode("Once upon a time")
        )
        assert s.ttft_s > 0 and s.decode_tok_s > 0 and s.prefill_tok_s > 0
        assert s.misses > 0 and s.bytes_read == s.misses * vault.manifest.record.stride
        assert s.prefill_unique_experts > 0
        again, _, _ = await collect(engine, "Once upon a time", max_tokens=12, stop_at_eos=False)
        assert again == tokens  # greedy is deterministic, whatever the ring holds


@pytest.mark.asyncio
async def test_stops_at_eos(vault):
    async with Engine.open(vault.path) as engine:
        first, _, _ = await collect(engine, [5, 6, 7], max_tokens=3, stop_at_eos=False)
        engine.tokenizer.eos_token_ids = {first[1]}
        tokens, _, last = await collect(engine, [5, 6, 7], max_tokens=10)
        assert tokens == first[:1] and last.finish_reason == "stop"


@pytest.mark.asyncio
async def test_sampling_is_seeded(vault):
    async with Engine.open(vault.path) as engine:
        kw = dict(
            max_tokens=16,
            temperature=1.5,
            top_p=0.95,
            top_k=50,
            min_p=0.01,
            repetition_penalty=1.1,
            stop_at_eos=False,
        )
        a, _, _ = await collect(engine, [5, 6, 7], seed=1, **kw)
        b, _, _ = await collect(engine, [5, 6, 7], seed=1, **kw)
        c, _, _ = await collect(engine, [5, 6, 7], seed=2, **kw)
        assert a == b and a != c


@pytest.mark.asyncio
async def test_breaking_out_leaves_the_engine_usable(vault):
    prompt = list(range(10, 40))
    async with Engine.open(vault.path, slots=4) as fresh:
        expected, _, _ = await collect(fresh, prompt, max_tokens=8, stop_at_eos=False)
        expected_logits = await fresh.logits(prompt)
    async with Engine.open(vault.path, slots=4) as engine:
        async for ev in engine.generate(prompt, max_tokens=50, stop_at_eos=False):
            if ev.token is not None:
                break
        assert np.array_equal(await engine.logits(prompt), expected_logits)
        tokens, _, _ = await collect(engine, prompt, max_tokens=8, stop_at_eos=False)
        assert tokens == expected
        assert set(engine.debug.scheduler.holders()) <= {RESIDENT}  # no request holds a slot


@pytest.mark.asyncio
async def test_cancelling_the_task_leaves_the_engine_usable(vault):
    prompt = list(range(10, 40))
    async with Engine.open(vault.path, slots=4) as engine:
        expected, _, _ = await collect(engine, prompt, max_tokens=6, stop_at_eos=False)
        seen = asyncio.Event()

        async def consume():
            async for ev in engine.generate(prompt, max_tokens=200, stop_at_eos=False):
                if ev.token is not None:
                    seen.set()

        task = asyncio.get_running_loop().create_task(consume())
        await seen.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        tokens, _, _ = await collect(engine, prompt, max_tokens=6, stop_at_eos=False)
        assert tokens == expected
        engine.debug.scheduler.check_invariants()


@pytest.mark.asyncio
async def test_bad_input_fails_before_any_work(vault):
    top_k = vault.manifest.shape.experts_per_token
    with pytest.raises(SmoeError, match=f"{top_k} expert slots") as info:
        async with Engine.open(vault.path, memory="10KB"):
            pass
    assert "smallest that works is --memory" in str(info.value)
    async with Engine.open(vault.path, max_context=64) as engine:
        with pytest.raises(SmoeError, match="exceed the context of 64"):
            await collect(engine, list(range(1, 60)), max_tokens=10)
        with pytest.raises(SmoeError, match="empty"):
            await engine.logits([])
        with pytest.raises(SmoeError, match="outside the vocabulary"):
            await engine.logits([1, 10**6])
        with pytest.raises(SmoeError, match="temperature"):
            await collect(engine, [1, 2], temperature=-1)
        for bad in (float("nan"), float("inf")):  # NaN passes "< 0": checked apart
            with pytest.raises(SmoeError, match="temperature must be a finite number"):
                await collect(engine, [1, 2], temperature=bad)
            with pytest.raises(SmoeError, match="top_p must be a finite number"):
                await collect(engine, [1, 2], top_p=bad)
        assert engine.stats().scheduler.misses == 0  # nothing was read


def test_vault_mismatch_names_the_file(vault, tmp_path):
    import shutil

    bad = tmp_path / "v"
    shutil.copytree(vault.path, bad)
    edit_json(bad / "manifest.json", version=2)
    with pytest.raises(VaultError, match="manifest.json is vault format version 2"):
        Engine.open(bad)
    edit_json(bad / "manifest.json", version=1)
    (bad / "backbone.safetensors").unlink()
    with pytest.raises(VaultError, match="backbone.safetensors is missing"):
        Engine.open(bad)


def test_cli_generate_json(vault, run_cli):
    code, out, _ = run_cli(
        "generate",
        vault.path,
        "--prompt-ids",
        "5,6,7",
        "--max-tokens",
        "6",
        "--json",
        "--slots",
        "4",
    )
    assert code == 0
    result = json.loads(out)
    assert len(result["tokens"]) <= 6 and isinstance(result["text"], str)
    assert result["stats"]["ring_slots"] == 4
    code, out, err = run_cli("generate", vault.path, "--prompt", "hello", "--max-tokens", "4")
    assert code == 0 and "tok/s" in err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--prompt-ids", "1,2", "--memory", "1KB"], "smallest that works is --memory"),
        (["--prompt-ids", "1,2", "--max-tokens", "999999"], "exceed the context"),
        ([], "exactly one of --prompt"),
        (["--prompt-ids", "1,2", "--hint-depth", "6"], "needs a '+hint' policy"),
        (["--prompt-ids", "1,2", "--policy", "arc+hint"], "takes no hints"),
        (["--prompt-ids", "1,2", "--policy", "bogus"], "unknown policy 'bogus'"),
        (["--prompt-ids", "1,2", "--spec", "-1"], "spec (gate-echo bets) must lie in 0..6"),
        (["--prompt-ids", "1,2", "--workers", "0"], "workers must lie in 1..256"),
        # issue 30 (CLI fuzz): 10**20 I/O threads were started until the machine gave out
        (["--prompt-ids", "1,2", "--workers", "99999999999999999999"], "workers must lie in"),
        # issue 30: 100 million slots were allocated and crashed (SIGSEGV, no message)
        (["--prompt-ids", "1,2", "--slots", "100000000"], "is more than the 24 experts"),
        (["--prompt-ids", "1,2", "--prefill-chunk", "0"], "prefill_chunk must be at least 1"),
    ],
)
def test_cli_generate_errors(vault, run_cli, args, needle):
    code, _, err = run_cli("generate", vault.path, *args)
    assert code == 1 and needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


BAD_OPTIONS = [
    {"policy": "bogus"},
    {"policy": "arc+hint"},
    {"policy": "lru+hint", "hint_depth": 99},
    {"hint_depth": 4},
    {"spec": -1},
    {"spec": 100},
    {"workers": 0},
    {"read_parts": 0},
    {"max_batch": 0},
    {"prefill_chunk": 0},
    {"dtype": "float8"},
    {"device": "tpu"},
    {"ring": "elsewhere"},
    {"memory": "lots"},
    {"memory": "1KB"},
    {"slots": 10**8},
]


@pytest.mark.asyncio
@pytest.mark.parametrize("options", BAD_OPTIONS, ids=lambda o: ",".join(map(str, o.values())))
async def test_a_bad_option_leaves_nothing_open(vault, options):
    """Every bad option is a SmoeError, raised before the engine holds a file, a thread or
    a ring: the process's open descriptors and threads are the same after as before."""
    import threading

    def open_fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))

    before_fds, before_threads = open_fds(), threading.active_count()
    with pytest.raises(SmoeError):
        async with Engine.open(vault.path, **options):
            pass
    assert open_fds() <= before_fds
    assert threading.active_count() <= before_threads


@pytest.mark.asyncio
async def test_partly_resident_layers_compute_the_same(vault):
    """Experts already in the ring are computed while the misses load; the logits must
    not change by a bit."""
    prompt = list(range(20, 150))
    async with Engine.open(vault.path) as everything:
        expected = await everything.logits(prompt)
    # 20 slots for 3 layers x 8 experts: LRU keeps part of each layer between chunks.
    async with Engine.open(vault.path, slots=20) as engine:
        await engine.logits(prompt[:40])  # leave some experts behind
        engine.debug.tracer.counters.calls.clear()
        assert np.array_equal(await engine.logits(prompt), expected)
        mixed = [
            t
            for t in engine.debug.tracer.counters.calls
            if t.waves == 1 and 0 < t.resident < t.unique_experts
        ]
        assert mixed, "no layer was partly resident: the overlapped path was not exercised"


@pytest.mark.asyncio
@pytest.mark.parametrize("slots", [4, 12])
async def test_gate_echo_bets_change_no_bit(vault, slots):
    """With --spec, speculative reads of the gate's next ranks run beside demand; tokens and
    per-step decode logits stay bit-identical."""
    import mlx.core as mx

    from smoe.compute.tracing import forward_pass
    from smoe.sampling import SamplingParams
    from smoe.sched.types import Priority

    async def decode_logits(engine):
        seq = await engine.debug.compute.run(
            engine.debug.runner.start, list(range(10, 40)), SamplingParams()
        )
        steps = []
        for _ in range(12):

            def one():
                with forward_pass(1):  # a decode pass: bets are placed in decode only
                    y = engine.debug.runner.model(mx.array(seq.tokens[-1:])[None], cache=seq.cache)
                out = np.array(y[0, -1])
                seq.tokens.append(int(out.argmax()))
                return out

            steps.append(await engine.debug.compute.run(one))
        return steps

    async with Engine.open(vault.path, slots=slots) as plain:
        expected = await decode_logits(plain)
    async with Engine.open(vault.path, slots=slots, spec=4) as betting:
        got = await decode_logits(betting)
        spec_reads = betting.debug.scheduler.stats.by_priority[Priority.SPECULATIVE].reads
        betting.debug.scheduler.check_invariants()
    assert all(np.array_equal(a, b) for a, b in zip(expected, got, strict=True))
    assert spec_reads > 0  # the bets really ran


@pytest.mark.asyncio
async def test_default_budget_never_exceeds_available_memory(vault, monkeypatch):
    import smoe.plan.ring as engine_module

    m = vault.manifest
    monkeypatch.setattr(engine_module, "available_memory", lambda: None)
    async with Engine.open(vault.path) as engine:
        assert engine.stats().ring.slots == m.num_records  # unknown: every expert
    backbone = vault.backbone_path.stat().st_size
    room = 2 * (backbone + 5 * m.record.stride)  # half of it holds the backbone + 5 records
    monkeypatch.setattr(engine_module, "available_memory", lambda: room)
    async with Engine.open(vault.path) as engine:
        assert engine.stats().ring.slots == 5
    monkeypatch.setattr(engine_module, "available_memory", lambda: 0)
    async with Engine.open(vault.path) as engine:  # never below one token's top-k
        assert engine.stats().ring.slots == m.shape.experts_per_token


@pytest.mark.asyncio
async def test_device_option(vault):
    """--device cpu computes on the CPU (also where a GPU is the default); a device this
    MLX build lacks, or a name that is none, is a one-line error before any work."""
    import mlx.core as mx

    from smoe.errors import SmoeError

    async with Engine.open(vault.path, device="cpu") as engine:
        assert mx.default_device() == mx.cpu
        assert (await engine.logits([5, 6, 7])).shape[0] == 3
    with pytest.raises(SmoeError, match="cpu or gpu"):
        Engine.open(vault.path, device="tpu")  # a name that is none: refused when made
    if not mx.is_available(mx.gpu):  # a device this build lacks: refused when opened
        engine = Engine.open(vault.path, device="gpu")
        with pytest.raises(SmoeError, match="no gpu backend"):
            await engine.__aenter__()
        await engine.aclose()
