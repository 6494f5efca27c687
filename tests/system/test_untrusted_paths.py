"""Paths a vault, a download or the Hugging Face cache hands us are untrusted (issue 49):
a manifest's side files ("source.copied") cannot reach outside the vault, a FIFO where a
file should be is one line instead of a hang, a cache ref cannot lead outside the
repository's snapshots, and `smoe inspect` prints what `smoe generate` runs.

The manifest's signature is no defence here: it is unkeyed, so whoever hands out a vault
signs what they like (``sign_manifest``), as these tests do.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from smoe.vault.format import file_checksum
from smoe.vault.manifest import SIGNATURE, sign_manifest
from tests.conftest import tiny_vault

ROOT = Path(__file__).resolve().parents[2]
SECRET = b"-----BEGIN OPENSSH PRIVATE KEY----- not for export\n"
REPO = "smoe-tests/tiny-moe"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
HANG_S = 90  # a case still running after this hangs


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(a tiny vault's folder, the download it was converted from)."""
    root = tmp_path_factory.mktemp("untrusted")
    vault = tiny_vault(root, seed=49)
    return vault.path, root / "src"


def signed_edit(vault_dir: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    """Edit manifest.json with ``fn`` and sign it again, as anyone handing out a vault can."""
    path = vault_dir / "manifest.json"
    m = json.loads(path.read_text())
    m.pop(SIGNATURE, None)
    fn(m)
    path.write_text(json.dumps(sign_manifest(m)))


def one_line(code: int, err: str) -> bool:
    lines = [x for x in err.splitlines() if x.strip()]
    return code == 1 and len(lines) == 1 and "Traceback" not in err


# ------------------------------------------------------------- item 4: source.copied


def _copy_name(name: Callable[[Path, Path], str], checksum: bool = False, legacy: bool = False):
    """A case: ``name(vault, secret)`` added to source.copied (with the secret's checksum,
    or in a vault made before side-file checksums: none at all)."""

    def apply(v: Path, secret: Path) -> None:
        entry = name(v, secret)

        def edit(m: dict[str, Any]) -> None:
            if entry not in m["source"]["copied"]:
                m["source"]["copied"].append(entry)
            if checksum:
                m["source"]["checksums"][entry] = file_checksum(secret)
            if legacy:
                del m["source"]["checksums"]

        signed_edit(v, edit)

    return apply


def _link(as_name: str) -> Callable[[Path, Path], str]:
    def make(v: Path, secret: Path) -> str:
        (v / as_name).unlink(missing_ok=True)
        (v / as_name).symlink_to(secret)
        return as_name

    return make


COPIED_CASES = {
    "absolute path": _copy_name(lambda v, s: str(s)),
    "../ path": _copy_name(lambda v, s: os.path.relpath(s, v)),
    "link out, no checksum": _copy_name(_link("notes.txt")),
    "link out, its checksum": _copy_name(_link("notes.txt"), checksum=True),
    "old vault: link out": _copy_name(_link("tokenizer.json"), legacy=True),
    "old vault: ../ path": _copy_name(lambda v, s: os.path.relpath(s, v), legacy=True),
}


def test_a_manifest_cannot_export_or_vouch_for_files_outside_the_vault(made, tmp_path, run_cli):
    """Export copied whatever source.copied named (an absolute or ../ path, a link out of
    the vault: ~/.ssh/id_rsa landed in the export) and inspect --verify called that vault
    clean. Now each is one line naming the field or file, and nothing is exported."""
    vault, _ = made
    secret = tmp_path / "id_rsa"
    secret.write_bytes(SECRET)
    problems = []
    for case, damage in COPIED_CASES.items():
        v = tmp_path / case.replace(" ", "_").replace("/", "_").replace(":", "") / "v"
        shutil.copytree(vault, v)
        damage(v, secret)
        out = v.parent / "out"
        code, _, err = run_cli("export", v, out)
        exported = [p for p in out.rglob("*") if p.is_file()] if out.exists() else []
        if any(SECRET in p.read_bytes() for p in exported):
            problems.append(f"{case}: export copied the secret")
        elif not one_line(code, err) or out.exists():
            problems.append(f"{case}: export exit {code}: {err}")
        if [n for n in os.listdir(v.parent) if n.startswith(".")]:
            problems.append(f"{case}: export left a temporary folder")
        code, stdout, err = run_cli("inspect", v, "--verify", "--quiet")
        # Refused at open (a path: one line), or reported as a bad file (a link out).
        if not (one_line(code, err) or (code == 1 and "BAD file" in stdout)):
            problems.append(f"{case}: inspect --verify exit {code}: {(err or stdout)[-200:]}")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------- item 10: FIFOs, Hub refs


def _fifo_at(rel: str, drop_index: bool = False) -> Callable[[Path], None]:
    def make(folder: Path) -> None:
        if drop_index:
            (folder / "model.safetensors.index.json").unlink()
            for p in folder.glob("model-*.safetensors"):
                p.rename(folder / "model.safetensors")
        (folder / rel).unlink(missing_ok=True)
        os.mkfifo(folder / rel)

    return make


# (folder: "download", "vault" or "hub", what becomes a FIFO, the command run on it)
FIFO_CASES: list[tuple[str, str, Callable[[Path], None], list[str]]] = [
    ("download", "model.safetensors", _fifo_at("model.safetensors", True), ["generate"]),
    ("download", "index", _fifo_at("model.safetensors.index.json"), ["generate"]),
    ("download", "model.safetensors", _fifo_at("model.safetensors", True), ["convert"]),
    ("download", "shard", _fifo_at("model-00001-of-00001.safetensors"), ["convert"]),
    ("download", "config.json", _fifo_at("config.json"), ["convert"]),
    ("vault", "manifest.json", _fifo_at("manifest.json"), ["generate"]),
    ("vault", "tokenizer.json", _fifo_at("tokenizer.json"), ["generate"]),
    ("vault", "tokenizer.json", _fifo_at("tokenizer.json"), ["inspect", "--verify", "--quiet"]),
    ("vault", "tokenizer.json", _fifo_at("tokenizer.json"), ["export"]),
    ("hub", "refs/main", _fifo_at("refs/main"), ["generate"]),
]


def _hub_cache(root: Path, src: Path) -> tuple[Path, Path]:
    """A Hugging Face cache holding REPO's snapshot of ``src``: (cache, repository folder)."""
    repo = root / "hub" / ("models--" + REPO.replace("/", "--"))
    shutil.copytree(src, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return root / "hub", repo


def test_a_fifo_where_a_file_should_be_is_one_line_not_a_hang(made, tmp_path):
    """A FIFO blocks open() and read() until a writer comes: as a download's shard, index
    or config, a vault's manifest or tokenizer file, or the Hub cache's ref, it hung
    generate, convert, inspect and export for ever. Each case runs in its own process
    (all at once); one still running after HANG_S hangs."""
    vault, src = made
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    procs = []
    for i, (kind, what, make, argv) in enumerate(FIFO_CASES):
        work = tmp_path / str(i)
        if kind == "hub":
            cache, repo = _hub_cache(work, src)
            make(repo)
            target, extra = REPO, {"HF_HUB_CACHE": str(cache)}
        else:
            target, extra = work / kind, {}
            shutil.copytree(vault if kind == "vault" else src, target)
            make(target)
        args = [argv[0], str(target)]
        args += [str(work / "out")] if argv[0] in ("convert", "export") else []
        args += argv[1:] + (["--prompt-ids", "1,2", "--max-tokens", "1"] * (argv[0] == "generate"))
        cmd = [sys.executable, "-m", "smoe.cli", *args]
        p = subprocess.Popen(
            cmd, env={**env, **extra}, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        procs.append((f"{kind} {what}: smoe {' '.join(argv)}", p))
    deadline = time.monotonic() + HANG_S
    bad = []
    for case, p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            bad.append(f"{case}: hung")
            continue
        text, report = err.decode(errors="replace"), out.decode(errors="replace")
        if "--verify" in case:  # a bad file is reported as such, exit 1
            if not (
                p.returncode == 1 and "BAD file: tokenizer.json" in report and "FIFO" in report
            ):
                bad.append(f"{case}: exit {p.returncode}: {(text or report)[-300:]}")
        elif not (one_line(p.returncode, text) and "FIFO" in text):
            bad.append(f"{case}: exit {p.returncode}: {text[-300:]}")
    assert not bad, "\n".join(bad)


def test_an_engine_that_fails_to_open_exits_with_its_one_line(made, tmp_path):
    """An engine whose tokenizer file is missing fails to open after its compute thread ran
    MLX: the process printed the one line, then one run in two died in MLX's thread-local
    destructors as the interpreter finalized ("terminate called without an active
    exception", exit 134). Six runs one after another (the race needs an idle machine:
    runs side by side hid it), each must exit 1 with the line alone."""
    vault, _ = made
    v = tmp_path / "v"
    shutil.copytree(vault, v)
    (v / "tokenizer.json").unlink()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "smoe.cli", "generate", str(v), "--prompt-ids", "1,2"]
    bad = []
    for _ in range(6):
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
        if not one_line(p.returncode, p.stderr):
            bad.append((p.returncode, p.stderr[-300:]))
    assert not bad, f"{len(bad)} of 6 runs: {bad[0]}"


def _thread_runs(tid: int) -> bool:
    return os.path.exists(f"/proc/self/task/{tid}")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux's /proc")
@pytest.mark.asyncio
async def test_the_compute_thread_is_gone_when_close_returns():
    """The cause of the exit 134 above, without its timing: ComputeThread.close returned
    once Python had joined the thread, with its OS thread still running MLX's thread-local
    destructors (one close in five). Now it returns once that thread has exited."""
    import threading

    import mlx.core as mx

    from smoe.compute.worker import ComputeThread

    def job() -> int:
        mx.eval(mx.ones(4) + 1)  # MLX's per-thread state, destroyed as the thread exits
        return threading.get_native_id()

    running = 0
    for _ in range(100):
        compute = ComputeThread()
        tid = await compute.run(job)
        await compute.close()
        running += _thread_runs(tid)  # at once: close() must have waited
    assert running == 0, f"{running} of 100 compute threads still ran after close()"


def test_a_hub_cache_cannot_lead_outside_the_repository(made, tmp_path, run_cli, monkeypatch):
    """The cache's refs/main was joined as it stood to the snapshots folder: "../../../x"
    ran a model from outside the cache (and "../../x" another folder in it); a snapshot
    that is a link out was followed. Each is now one line naming the fix."""
    import huggingface_hub.constants as constants

    _, src = made
    cases: dict[str, Callable[[Path], None]] = {
        "ref ../../../outside": lambda repo: (repo / "refs" / "main").write_text(
            "../../../outside"
        ),
        "ref ../../outside": lambda repo: (repo / "refs" / "main").write_text("../../outside"),
        "snapshot linked out": lambda repo: (
            shutil.rmtree(repo / "snapshots" / COMMIT),
            (repo / "snapshots" / COMMIT).symlink_to(repo.parent.parent / "outside"),
        ),
    }
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ran = []
    for case, damage in cases.items():
        work = tmp_path / case.replace(" ", "_").replace("/", "_")
        cache, repo = _hub_cache(work, src)
        shutil.copytree(src, work / "outside")  # outside the cache: "../../../outside"
        shutil.copytree(src, cache / "outside")  # in the cache, not a snapshot: "../../outside"
        damage(repo)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
        code, out, err = run_cli("inspect", REPO)
        if not (one_line(code, err) and "Hugging Face cache" in err):
            ran.append(f"{case}: exit {code}: {(err or out).splitlines()[0]}")
    assert not ran, "\n".join(ran)


# ------------------------------------------------------------- item 7: inspect, RLIMIT_NOFILE


def test_inspect_prints_every_manifest_generate_runs(made, tmp_path, run_cli):
    """A manifest without quantization.backbone, or whose experts list only their
    per-projection packing, opens and runs; inspect raised KeyError on both."""
    vault, _ = made

    def no_backbone(m: dict[str, Any]) -> None:
        del m["quantization"]["backbone"]

    def per_projection(m: dict[str, Any]) -> None:
        q = m["quantization"]["experts"]
        per = {p: dict(q) for p in ("gate_proj", "up_proj", "down_proj")}
        m["quantization"]["experts"] = {"projections": per}

    failed = []
    for name, edit in {"no backbone entry": no_backbone, "per projection": per_projection}.items():
        v = tmp_path / name.replace(" ", "_") / "v"
        shutil.copytree(vault, v)
        signed_edit(v, edit)
        code, _, err = run_cli("generate", v, "--prompt-ids", "1,2", "--max-tokens", "1")
        assert code == 0, (name, err)
        try:
            code, out, err = run_cli("inspect", v)
        except Exception as e:  # noqa: BLE001 (what the old code raised: counted, reported)
            failed.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if code != 0 or "quantized  experts:" not in out:
            failed.append(f"{name}: exit {code}: {err}")
    assert not failed, failed


def test_a_hard_open_file_limit_below_4096_runs_and_is_kept(made):
    """mlx-lm's import sets RLIMIT_NOFILE to (2048, 4096): under a hard limit of 1024 that
    was a ValueError traceback from every command that imports it, and above 4096 it
    lowered the hard limit for good. Now the soft limit rises within the hard one, which
    stays as it was."""
    import resource

    vault, _ = made
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    _, hard_now = resource.getrlimit(resource.RLIMIT_NOFILE)

    def run(limits: tuple[int, int], *cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *cmd],
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limits),
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )

    gen = ("-m", "smoe.cli", "generate", str(vault), "--prompt-ids", "1,2", "--max-tokens", "1")
    p = run((1024, 1024), *gen)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    probe = "import smoe, mlx_lm, resource; print(*resource.getrlimit(resource.RLIMIT_NOFILE))"
    got = {}
    for limits in [(512, 1024), (1024, 1024)] + ([(1024, 8192)] if hard_now >= 8192 else []):
        p = run(limits, "-c", probe)
        assert p.returncode == 0, (limits, p.stderr[-2000:])
        got[limits] = tuple(int(x) for x in p.stdout.split())
    want = {(512, 1024): (1024, 1024), (1024, 1024): (1024, 1024), (1024, 8192): (2048, 8192)}
    assert got == {k: want[k] for k in got}
