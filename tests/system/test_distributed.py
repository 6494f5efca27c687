"""Expert parallelism over mx.distributed (docs/distributed.md).

Two ranks run as two local processes on MLX's ring backend over loopback, each with a
ring smaller than half the experts. They must give the single process's logits and
tokens, and mlx-lm's in memory, bit for bit; a rank killed mid-generation must give a
clean one-line error on rank 0 within a bounded time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from smoe.engine import Engine
from smoe.errors import SmoeError
from smoe.parallel.assignment import ExpertAssignment
from smoe.parallel.watchdog import Watchdog
from smoe.vault.convert import ConvertOptions, convert
from tests.conftest import tiny_vault
from tests.exact.test_engine_exact import (
    _prompt,
    engine_decode,
    engine_generate,
    reference_decode,
    reference_logits,
    reference_model,
)

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12


# --------------------------------------------------------------------------- assignment
def test_every_expert_has_one_owner_and_the_split_is_even_without_history():
    a = ExpertAssignment.balanced([1, 3, 5], experts=10, ranks=3)
    assert a.owners.shape == (3, 10)
    keys = [a.owned_keys(r) for r in range(3)]
    assert sorted(k for ks in keys for k in ks) == [
        (layer, e) for layer in (1, 3, 5) for e in range(10)
    ]
    assert [len(k) for k in keys] == [12, 9, 9]  # e mod 3: 4, 3, 3 of each layer's 10
    assert a.owns(1, 3, 4) and not a.owns(0, 3, 4)
    assert a.owned(2, 5).tolist() == [e % 3 == 2 for e in range(10)]


def test_popularity_balances_each_layers_expected_work():
    """Greedy largest-first: a layer whose two hottest experts are ids 0 and 2 (both even)
    splits them across the ranks, where e mod 2 would give both to rank 0."""
    counts = np.array([[100, 1, 90, 1, 5, 5, 5, 5]], dtype=np.float64)
    a = ExpertAssignment.balanced([0], experts=8, ranks=2, popularity=counts)
    load = [counts[0][a.owned(r, 0)].sum() for r in range(2)]
    assert max(load) - min(load) <= 10  # 107 against 105
    plain = ExpertAssignment.balanced([0], experts=8, ranks=2)
    assert max(counts[0][plain.owned(r, 0)].sum() for r in range(2)) == 200
    again = ExpertAssignment.balanced([0], experts=8, ranks=2, popularity=counts.copy())
    assert np.array_equal(a.owners, again.owners) and a.fingerprint() == again.fingerprint()


def test_a_changed_owner_changes_the_fingerprint_and_bad_assignments_are_refused():
    a = ExpertAssignment.balanced([0, 1], experts=4, ranks=2)
    owners = a.owners.copy()
    owners[1, 3] = 0
    assert ExpertAssignment(a.layers, owners, 2).fingerprint() != a.fingerprint()
    with pytest.raises(SmoeError, match="outside"):
        ExpertAssignment(a.layers, owners + 5, 2)
    with pytest.raises(SmoeError, match="at least one rank"):
        ExpertAssignment.balanced([0], experts=4, ranks=0)


def test_the_watchdog_fires_once_when_a_collective_waits_too_long():
    """A controlled clock: no sleeps. Blocks shorter than the timeout never fire."""
    now = [0.0]
    said: list[str] = []
    dog = Watchdog(10.0, on_hang=said.append, clock=lambda: now[0])
    with dog.watch("a quick sum"):
        now[0] += 9.0
        assert not dog.check()
    now[0] += 100.0  # nothing in progress: nothing to fire about
    assert not dog.check() and said == []
    with dog.watch("a layer's sum"):
        now[0] += 10.5
        assert dog.check() and dog.check()
    dog.close()
    assert len(said) == 1 and "a layer's sum waited more than 10 s" in said[0]


# --------------------------------------------------------------------------- one process
@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    return tiny_vault(tmp_path_factory.mktemp("dist"), seed=11)


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
async def test_a_group_of_one_computes_what_the_plain_engine_does(vault):
    """The sharded path (every expert owned, the sum an identity) on the same bits."""
    prompt = _prompt(40, seed=4)
    async with Engine.open(vault.path, slots=6) as engine:
        want = await engine.logits(prompt)
        want_tokens = await engine_generate(engine, prompt, 6)
    async with Engine.open(vault.path, slots=6, distributed="any") as engine:
        assert engine.group.distributed and engine.group.size == 1
        assert np.array_equal(await engine.logits(prompt), want)
        assert await engine_generate(engine, prompt, 6) == want_tokens
        io = await engine.group.rank_stats()
        assert [r["rank"] for r in io] == [0] and io[0][
            "experts_owned"
        ] == vault.manifest.num_records
        with pytest.raises(SmoeError, match="seed"):
            async for _ in engine.generate(prompt, max_tokens=2, temperature=0.7):
                pass


def test_an_unknown_backend_is_refused_before_anything_starts(vault):
    with pytest.raises(SmoeError, match="unknown distributed backend 'carrier-pigeon'"):
        Engine.open(vault.path, distributed="carrier-pigeon").options.check(2, 8)


# --------------------------------------------------------------------------- two ranks
def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def start_ranks(argv: list[str], tmp: Path, ranks: int = 2) -> list[subprocess.Popen[str]]:
    """``argv`` once per rank on MLX's ring backend over loopback, as mlx.launch starts
    them (MLX_RANK and a hostfile of one address per rank); "{rank}" in an argument
    becomes the rank."""
    hostfile = tmp / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(ranks)]))
    env = dict(os.environ, MLX_HOSTFILE=str(hostfile), PYTHONPATH=str(ROOT))
    return [
        subprocess.Popen(
            [sys.executable, *(a.replace("{rank}", str(r)) for a in argv)],
            cwd=ROOT,
            env=env | {"MLX_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(ranks)
    ]


def finish(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str, str]]:
    out = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("a rank hung") from None
        out.append((p.returncode, stdout, stderr))
    return out


@pytest.mark.parametrize(
    ("arch", "whole"),
    [
        ("qwen3_moe", False),
        ("qwen2_moe", False),  # a shared expert
        ("qwen3_moe", True),  # each layer in one call with the others' rows zeroed (the GPU's way)
    ],
)
@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
async def test_two_ranks_give_the_bits_of_one_process_and_of_mlx_lm(arch, whole, hf_dir, tmp_path):
    vault = convert(hf_dir(arch), tmp_path / "v", ConvertOptions(dtype="float32"))
    ref = reference_model(vault, tmp_path / "mlx")
    prompt = _prompt(70, seed=2)
    ref_tokens, ref_steps = reference_decode(ref, prompt, STEPS)
    slots = vault.manifest.num_records // 4  # per rank: under half of all experts
    out = tmp_path / "out"
    out.mkdir()
    argv = ["-m", "tests.distributed_worker", str(vault.path), str(out), str(slots)]
    argv += [",".join(map(str, prompt)), str(STEPS), ",".join(map(str, ref_tokens))]
    argv += ["whole"] if whole else []
    procs = start_ranks(argv, tmp_path)
    async with Engine.open(vault.path, slots=slots) as engine:  # meanwhile: one process
        solo = await engine.logits(prompt)
        solo_steps, _ = await engine_decode(engine, prompt, ref_tokens)
        solo_tokens = await engine_generate(engine, prompt, STEPS)
    for rc, _, stderr in finish(procs, timeout=300):
        assert rc == 0, stderr[-3000:]
    assert solo_tokens == ref_tokens
    for rank in range(2):
        got = np.load(out / f"rank{rank}.npz")
        report = json.loads((out / f"rank{rank}.json").read_text())
        assert report["size"] == 2 and report["ring_slots"] == slots
        assert np.array_equal(got["logits"], solo)
        assert np.array_equal(got["logits"], reference_logits(ref, prompt))
        for i, (a, b, c) in enumerate(zip(got["steps"], solo_steps, ref_steps, strict=True)):
            assert np.array_equal(a, b) and np.array_equal(a, c), f"rank {rank}, step {i}"
        assert report["picks"] == report["tokens"] == ref_tokens
        full = prompt + ref_tokens
        assert np.array_equal(got["full"], reference_logits(ref, full))
        owned = report["owned"]
        assert sum(owned) == vault.manifest.num_records and slots < owned[rank]
    io = json.loads((out / "rank0.json").read_text())["io"]
    assert [r["rank"] for r in io] == [0, 1] and all(r["bytes_read"] > 0 for r in io)


def test_smoe_generate_under_mlx_launch_prints_once_the_single_process_tokens(vault, tmp_path):
    """The user's way in: mlx.launch starts both ranks; rank 0 prints one JSON object."""
    launch = Path(sys.executable).parent / "mlx.launch"
    if not launch.exists():
        pytest.skip("mlx.launch is not installed beside this Python")
    args = ["generate", str(vault.path), "--prompt-ids", "5,6,7,8", "--max-tokens", "8"]
    args += ["--slots", "6", "--json", "--temp", "0.8", "--seed", "3"]
    solo = subprocess.run(
        [sys.executable, "-m", "smoe.cli", *args], capture_output=True, text=True, cwd=ROOT
    )
    assert solo.returncode == 0, solo.stderr
    ports = _free_ports(1)[0]
    both = subprocess.run(
        [str(launch), "-n", "2", "--backend", "ring", "-p", str(ports), "--"]
        + [sys.executable, "-m", "smoe.cli", *args, "--distributed"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert both.returncode == 0, both.stderr[-3000:]
    printed = [json.loads(line) for line in both.stdout.splitlines() if line.startswith("{")]
    assert len(printed) == 1  # rank 0 alone talks to the user
    assert printed[0]["tokens"] == json.loads(solo.stdout)["tokens"]
    assert [r["rank"] for r in printed[0]["stats"]["ranks"]] == [0, 1]


def test_two_ranks_stream_a_download_as_one_process_does(hf_dir, tmp_path, monkeypatch):
    """Expert parallelism straight from a Hugging Face folder (docs/sources.md): each rank
    reads the experts it owns from the original shards; rank 0 prints the solo tokens."""
    monkeypatch.setenv("SMOE_CACHE", str(tmp_path / "cache"))  # the source's statistics
    src = hf_dir("qwen3_moe")
    argv = ["-m", "smoe.cli", "generate", str(src), "--prompt-ids", "5,6,7,8,9,10"]
    argv += ["--max-tokens", "10", "--slots", "6", "--json", "--temp", "0"]
    solo = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT)
    assert solo.returncode == 0, solo.stderr[-3000:]
    outputs = finish(start_ranks([*argv, "--distributed"], tmp_path), timeout=300)
    for rc, _, stderr in outputs:
        assert rc == 0, stderr[-3000:]
    printed = [json.loads(line) for line in outputs[0][1].splitlines() if line.startswith("{")]
    assert len(printed) == 1 and outputs[1][1].strip() == ""  # rank 0 alone talks
    assert printed[0]["tokens"] == json.loads(solo.stdout)["tokens"]
    ranks = printed[0]["stats"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["bytes_read"] > 0 for r in ranks)


def test_a_killed_rank_ends_the_group_with_one_line_on_rank_0(vault, tmp_path):
    args = ["-m", "smoe.cli", "generate", str(vault.path), "--prompt-ids", "5,6,7"]
    args += ["--max-tokens", "4000", "--slots", "6", "--distributed", "ring"]
    rank0, rank1 = start_ranks(args, tmp_path)
    assert rank0.stdout is not None
    rank0.stdout.read(1)  # rank 0 is printing tokens: the ranks are mid-generation
    rank1.send_signal(signal.SIGKILL)
    started = time.monotonic()
    (rc, _, stderr), _ = finish([rank0, rank1], timeout=60)
    assert time.monotonic() - started < 60
    assert rc == 1, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "group broke" in lines[0], stderr[-3000:]
    assert "Traceback" not in stderr


def test_a_hung_rank_ends_the_group_after_the_collective_timeout(vault, tmp_path):
    """A stopped rank keeps its sockets open, so no backend notices: the watchdog does."""
    args = ["-m", "smoe.cli", "generate", str(vault.path), "--prompt-ids", "5,6,7"]
    args += ["--max-tokens", "4000", "--slots", "6", "--distributed", "ring"]
    args += ["--collective-timeout", "3"]
    rank0, rank1 = start_ranks(args, tmp_path)
    assert rank0.stdout is not None
    rank0.stdout.read(1)
    rank1.send_signal(signal.SIGSTOP)
    started = time.monotonic()
    try:
        rc = rank0.wait(timeout=60)
    finally:
        rank1.kill()
    stderr = rank0.stderr.read() if rank0.stderr is not None else ""
    assert rc == 1 and time.monotonic() - started < 30, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "waited more than 3 s" in lines[0], stderr[-3000:]
    finish([rank0, rank1], timeout=30)


# --------------------------------------------------------------------------- shards
@pytest.fixture(scope="module")
def shards(vault, tmp_path_factory):
    from smoe.parallel.cut import cut_shard

    root = tmp_path_factory.mktemp("shards")
    return [cut_shard(vault.path, root / f"rank{r}", ranks=2, rank=r) for r in range(2)]


def test_a_shard_holds_its_ranks_records_byte_for_byte(vault, shards, run_cli):
    m = vault.manifest
    stride = m.record.stride
    full = vault.experts_path.read_bytes()
    keys = []
    for r, shard in enumerate(shards):
        s = shard.manifest
        assert s.shard is not None and (s.shard.rank, s.shard.ranks) == (r, 2)
        assert s.identity() == m.identity() and s.num_records == len(s.shard.keys)
        data = shard.experts_path.read_bytes()
        assert len(data) == s.num_records * stride
        for i, key in enumerate(s.shard.keys):
            at = m.record_index(*key)
            assert data[i * stride : (i + 1) * stride] == full[at * stride : (at + 1) * stride]
            assert s.checksums[i] == m.checksums[at] and s.record_index(*key) == i
        keys += list(s.shard.keys)
        code, out, _ = run_cli("inspect", str(shard.path), "--verify")
        assert code == 0, out
    assert sorted(keys) == sorted(m.record_key(i) for i in range(m.num_records))
    other = shards[1].manifest.shard.keys[0]
    with pytest.raises(IndexError, match="not in this shard"):
        shards[0].manifest.record_index(*other)


def test_bad_shard_requests_and_entries_are_one_line_errors(vault, shards, tmp_path, run_cli):
    from smoe.vault.format import Vault
    from smoe.vault.manifest import sign_manifest

    for args, said in [
        (["--ranks", "2", "--rank", "2"], "--rank 0..ranks-1"),
        (["--ranks", "0", "--rank", "0"], "--ranks 1.."),
    ]:
        code, _, err = run_cli("shard", str(vault.path), str(tmp_path / "x"), *args)
        assert code == 1 and said in err
    code, _, err = run_cli(
        "shard", str(shards[0].path), str(tmp_path / "y"), "--ranks", "2", "--rank", "0"
    )
    assert code == 1 and "already a shard" in err
    code, _, err = run_cli(
        "shard", str(vault.path), str(shards[1].path), "--ranks", "2", "--rank", "1"
    )
    assert code == 1 and "--force" in err
    code, _, err = run_cli("export", str(shards[0].path), str(tmp_path / "mlx"))
    assert code == 1 and "is a shard" in err
    raw = json.loads((shards[0].path / "manifest.json").read_text())
    for edit, said in [  # each re-signed: only the validation can refuse it
        (lambda d: d["shard"].update(rank=5), "shard.rank"),
        (lambda d: d["shard"]["owners"].pop(), "shard.owners"),
        (lambda d: d["shard"]["owners"][0].__setitem__(0, 7), "shard.owners[0][0]"),
        (
            lambda d: d["shard"]["owners"][0].__setitem__(0, 1 - d["shard"]["owners"][0][0]),
            "the shard holds",
        ),
    ]:
        bad = tmp_path / f"bad{len(said)}"
        if bad.exists():
            continue
        import shutil

        shutil.copytree(shards[0].path, bad)
        d = json.loads(json.dumps(raw))
        edit(d)
        (bad / "manifest.json").write_text(
            json.dumps(sign_manifest({k: v for k, v in d.items() if k != "manifest_checksum"}))
        )
        with pytest.raises(SmoeError, match=re.escape(said)):
            Vault.open(bad)


def test_a_shard_run_alone_is_one_line_naming_distributed(shards, tmp_path, run_cli):
    """Was IndexError "expert 0 of layer 0 is not in this shard" at the first token, also for
    a shard relabelled as the other rank and re-signed (issue 30)."""
    import shutil

    from smoe.vault.manifest import sign_manifest

    relabelled = tmp_path / "relabelled"
    shutil.copytree(shards[0].path, relabelled)
    d = json.loads((relabelled / "manifest.json").read_text())
    d["shard"]["rank"] = 1
    d.pop("manifest_checksum")
    (relabelled / "manifest.json").write_text(json.dumps(sign_manifest(d)))
    for path, rank in [(shards[0].path, 0), (shards[1].path, 1), (relabelled, 1)]:
        code, out, err = run_cli(
            "generate", str(path), "--prompt-ids", "1,2,3", "--max-tokens", "2"
        )
        assert code == 1 and out == "", (out, err)
        assert f"shard of rank {rank} of 2" in err and "--distributed" in err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_two_ranks_on_their_shards_compute_the_full_vaults_bits(vault, shards, tmp_path):
    prompt = _prompt(40, seed=6)
    out = tmp_path / "out"
    out.mkdir()
    root = shards[0].path.parent
    argv = ["-m", "tests.distributed_worker", str(root / "rank{rank}"), str(out), "4"]
    argv += [",".join(map(str, prompt)), "6", ",".join(["5"] * 6)]
    procs = start_ranks(argv, tmp_path)
    for rc, _, stderr in finish(procs, timeout=300):
        assert rc == 0, stderr[-3000:]

    async def solo():
        async with Engine.open(vault.path, slots=4) as engine:
            return await engine.logits(prompt), await engine_generate(engine, prompt, 6)

    from smoe.util.loop import run

    want, tokens = run(solo())
    for rank in range(2):
        got = np.load(out / f"rank{rank}.npz")
        assert np.array_equal(got["logits"], want)
        assert json.loads((out / f"rank{rank}.json").read_text())["tokens"] == tokens


def test_a_rank_given_another_ranks_shard_is_refused_on_every_rank(shards, tmp_path):
    root = shards[0].path.parent
    args = ["-m", "smoe.cli", "generate", str(root / "rank{rank}"), "--prompt-ids", "5,6"]
    swapped = start_ranks(
        [a.replace("rank{rank}", "rank1") for a in args] + ["--distributed"], tmp_path
    )
    for rc, _, stderr in finish(swapped, timeout=120):
        assert rc == 1 and "opened the shard cut for rank 1 of 2" in stderr, stderr[-2000:]


# --------------------------------------------------------------------------- serve across ranks
def _serve_and_ask(argv_for_rank, tmp_path, ranks: int) -> tuple[list[str], list[tuple[int, str]]]:
    """Start `smoe serve` (on ``ranks`` ranks), send concurrent completions (greedy and
    seeded), one streamed request dropped after its first event, then the same requests
    again; stop rank 0 with SIGINT. Returns the texts and every rank's (exit code, stderr)."""
    import concurrent.futures
    import urllib.request

    tmp_path.mkdir(parents=True, exist_ok=True)
    port = _free_ports(1)[0]
    argv = argv_for_rank + ["--port", str(port)]
    procs = (
        start_ranks(argv, tmp_path, ranks)
        if ranks > 1
        else [
            subprocess.Popen(
                [sys.executable, *argv],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        ]
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(base + "/health", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    # Idle, a following rank waits for rank 0's doorbell, not inside a (polling) collective.
    before = [_cpu_seconds(p.pid) for p in procs]
    time.sleep(2)
    idle = [_cpu_seconds(p.pid) - b for p, b in zip(procs, before, strict=True)]

    def post(body: dict) -> str:
        req = urllib.request.Request(
            base + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())["choices"][0]["text"]

    bodies = [{"prompt": [5, 6, 7, i], "max_tokens": 10, "temperature": 0} for i in range(8, 12)]
    bodies.append({"prompt": [9, 9, 9], "max_tokens": 8, "temperature": 0.9, "seed": 4})
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        texts = list(pool.map(post, bodies))
    dropped = urllib.request.Request(
        base + "/v1/completions",
        data=json.dumps({"prompt": [7, 7], "max_tokens": 200, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(dropped, timeout=120) as r:
        r.readline()  # one event, then the client goes away: the request is cancelled
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        texts += list(pool.map(post, bodies))
    with urllib.request.urlopen(base + "/v1/smoe/stats", timeout=120) as r:
        stats = json.loads(r.read())  # idle: rank 0 runs an iteration for the gather
    texts.append(json.dumps([(x["rank"], x["bytes_read"] > 0) for x in stats.get("ranks", [])]))
    texts.append(json.dumps([cpu < 0.5 for cpu in idle]))  # of 2 s
    procs[0].send_signal(signal.SIGINT)
    return texts, [(rc, err) for rc, _, err in finish(procs, timeout=120)]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_smoe_serve_across_two_ranks_answers_as_one_process(vault, tmp_path):
    """Rank 0 hears the clients and announces each iteration's requests and cancels; rank
    1 runs them too. The answers are one process's; stopping rank 0 ends rank 1 cleanly."""
    argv = ["-m", "smoe.cli", "serve", str(vault.path), "--slots", "6", "--max-batch", "4"]
    solo, (only,) = _serve_and_ask(argv, tmp_path / "one", 1)
    both, ranks = _serve_and_ask(argv + ["--distributed", "ring"], tmp_path / "two", 2)
    assert only[0] == 130, only[1][-2000:]  # SIGINT
    assert solo.pop() == "[true]" and both.pop() == "[true, true]"  # idle: no busy wait
    assert solo.pop() == "[]" and both.pop() == "[[0, true], [1, true]]"  # per-rank /stats
    assert both == solo and len(set(solo)) > 1
    (rc0, err0), (rc1, err1) = ranks
    assert rc0 == 130 and "Traceback" not in err0, err0[-2000:]
    assert rc1 == 0 and "following rank 0" in err1, err1[-2000:]


def test_smoe_chat_across_two_ranks_replies_as_one_process(vault, tmp_path):
    """Rank 0's REPL in a terminal, rank 1 following: the reply is one process's, /save
    is refused in one line (rank 1 cannot save its own cache), /quit ends both."""
    import pty

    from tests.system.test_chat_cli import _read_until

    def chat(argv: list[str], ranks: int) -> tuple[str, list[tuple[int, str]]]:
        primary, secondary = pty.openpty()
        env = {**os.environ, "TERM": "dumb", "COLUMNS": "200", "PYTHONPATH": str(ROOT)}
        procs = []
        if ranks > 1:
            hostfile = tmp_path / "hosts.json"
            hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(2)]))
            env |= {"MLX_HOSTFILE": str(hostfile)}
            procs.append(
                subprocess.Popen(
                    [sys.executable, *argv],
                    cwd=ROOT,
                    env=env | {"MLX_RANK": "1"},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        tty = subprocess.Popen(
            [sys.executable, *argv],
            cwd=ROOT,
            env=env | {"MLX_RANK": "0"},
            stdin=secondary,
            stdout=secondary,
            stderr=secondary,
            close_fds=True,
        )
        os.close(secondary)
        try:
            _read_until(primary, re.compile(r"Ctrl-D to quit"), 120)
            os.write(primary, b"In the beginning\r")
            seen = _read_until(primary, re.compile(r"In the beginning\n.*\w.*\n> ", re.S), 120)
            reply = seen.rsplit("In the beginning", 1)[1].rsplit("\n> ", 1)[0].strip()
            os.write(primary, b"/save " + str(tmp_path / "conv.npz").encode() + b"\r")
            saved = _read_until(primary, re.compile(r"/save .*\n.*\n> ", re.S), 60)
            os.write(primary, b"/quit\r")
            tty.wait(timeout=60)
        finally:
            os.close(primary)
            tty.kill()
        done = [(tty.returncode, saved)]
        for p in procs:
            _, err = p.communicate(timeout=60)
            done.append((p.returncode, err))
        return reply, done

    argv = ["-m", "smoe.cli", "chat", str(vault.path), "--temp", "0", "--max-tokens", "12"]
    solo, _ = chat(argv, 1)
    both, ((rc0, saved), (rc1, err1)) = chat(argv + ["--slots", "6", "--distributed", "ring"], 2)
    assert both == solo and solo
    assert rc0 == 0 and "not available while other ranks follow rank 0" in saved
    assert rc1 == 0 and "following rank 0" in err1, err1[-2000:]


def test_a_dead_follower_makes_rank_0_answer_503_at_once(vault, tmp_path):
    """Rank 0 sees a follower's doorbell connection close: the next request fails with a
    503 and one log line naming the rank, at once (no collective with the dead rank)."""
    import urllib.error
    import urllib.request

    port = _free_ports(1)[0]
    args = ["-m", "smoe.cli", "serve", str(vault.path), "--slots", "6", "--port", str(port)]
    rank0, rank1 = start_ranks(args + ["--distributed", "ring"], tmp_path)
    base = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(base + "/health", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 3}).encode()

    def ask() -> int:
        req = urllib.request.Request(
            base + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    assert ask() == 200
    rank1.kill()
    rank1.wait()
    time.sleep(0.5)  # the connection's end reaches rank 0's event loop
    started = time.monotonic()
    assert ask() == 503 and time.monotonic() - started < 5
    rank0.send_signal(signal.SIGINT)
    (rc, _, stderr), _ = finish([rank0, rank1], timeout=60)
    assert rc == 130 and "rank 1 hung up" in stderr and "Traceback" not in stderr, stderr[-2000:]
