"""Every file of a vault and of a shard, damaged the ways a disk or a hand damages them
(issue 30): removed, emptied, cut in half, extended, bytes flipped, replaced by random
bytes of its size, a directory in its place.

Each case is a copy of the vault (hard links, but a fresh copy of the file it damages)
run through the CLI in a worker process (this file run as a script), one JSON line per
case, so that a crash or a hang fails the test naming the case. A vault case runs `smoe
generate --json`, and again `smoe export`; a shard case runs `smoe inspect --verify` (a
shard runs only under mlx.launch with its other ranks). A case passes when it exits 0 with
the undamaged vault's tokens (an export: its files byte for byte), or exits 1 with our
one-line error (a shard's --verify: or its bad records); a traceback, another exit code,
a hang or other output fail it.

    python tests/test_file_fuzz.py VAULT WORKDIR [generate|export|shard]   # the worker
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("SMOE_FUZZ_SEED", "30"))
PROMPT = "1,2,3,4,5"
HANG_S = 60  # one case taking longer is a hang
Damage = Callable[[Path, random.Random], None]


# ----------------------------------------------------------------------------- damages


def _remove(p: Path, rng: random.Random) -> None:
    p.unlink()


def _empty(p: Path, rng: random.Random) -> None:
    p.write_bytes(b"")


def _half(p: Path, rng: random.Random) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _extended(p: Path, rng: random.Random) -> None:
    with open(p, "ab") as f:
        f.write(rng.randbytes(4096))


def _flips(count: int) -> Damage:
    def flip(p: Path, rng: random.Random) -> None:
        data = bytearray(p.read_bytes())
        for _ in range(count if data else 0):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        p.write_bytes(bytes(data))

    return flip


def _random(p: Path, rng: random.Random) -> None:
    p.write_bytes(rng.randbytes(p.stat().st_size))


def _directory(p: Path, rng: random.Random) -> None:
    p.unlink()
    p.mkdir()


DAMAGES: dict[str, Damage] = {
    "removed": _remove,
    "empty": _empty,
    "cut in half": _half,
    "extended by 4 KiB": _extended,
    "one bit flipped": _flips(1),
    "eight bits flipped": _flips(8),
    "random bytes": _random,
    "a directory": _directory,
}


def files_of(folder: Path) -> list[str]:
    """Every file under ``folder``, relative, sorted."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def cases(folder: Path) -> Iterator[tuple[str, str]]:
    for name in files_of(folder):
        for damage in DAMAGES:
            yield name, damage


LINKED = ("experts.bin", "backbone.safetensors")  # never written by a run: hard links


def copy_with(folder: Path, dst: Path, name: str) -> Path:
    """``folder`` at ``dst``: a copy (the two big files hard links), ``name`` a copy of its
    own (it is damaged); a run writes into stats/ without touching ``folder``."""

    def put(src: str, to: str) -> None:
        big = Path(src).name in LINKED and Path(src) != folder / name
        (os.link if big else shutil.copyfile)(src, to)

    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(folder, dst, copy_function=put)
    return dst


# ----------------------------------------------------------------------------- the worker


def _cli(argv: list[str]) -> tuple[int, str, str]:
    """`smoe ARGV` in this process: (exit code, stdout, stderr)."""
    from smoe.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
    return int(code or 0), out.getvalue(), err.getvalue()


def _exported(out: Path) -> dict[str, str]:
    """An export's files and their digests (what mlx-lm would load)."""
    import hashlib

    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


def _run(folder: Path, mode: str) -> tuple[int, Any, str]:
    shard = mode == "shard"
    if mode == "export":
        out = folder.parent / "exported"
        shutil.rmtree(out, ignore_errors=True)
        code, _, err = _cli(["export", str(folder), str(out)])
        return code, _exported(out) if code == 0 else None, err
    if shard:  # exit 1: a file or record reported BAD (on stdout), or our one-line error
        code, out, err = _cli(["inspect", str(folder), "--verify"])
        bad = [line for line in out.splitlines() if line.startswith("BAD")]
        if code != 1 or not bad:
            return code, None, err
        return code, None, "\n".join(bad) + ("\n" + err if "Traceback" in err else "")
    code, out, err = _cli(
        ["generate", str(folder), "--prompt-ids", PROMPT, "--max-tokens", "3", "--json"]
    )
    tokens = json.loads(out.strip().splitlines()[-1])["tokens"] if code == 0 else None
    return code, tokens, err


def _worker(folder: Path, work: Path, mode: str) -> None:
    shard = mode == "shard"
    import logging

    logging.disable(logging.WARNING)  # a warning line is allowed; the error line is judged
    work.mkdir(parents=True, exist_ok=True)
    code, baseline, err = _run(folder, mode)
    assert code == 0, f"the undamaged {'shard' if shard else 'vault'} fails: {err}"
    rng = random.Random(SEED)
    for i, (name, damage) in enumerate(cases(folder)):
        print(json.dumps({"start": i, "file": name, "damage": damage}), flush=True)
        case = copy_with(folder, work / "case", name)
        DAMAGES[damage](case / name, rng)
        faulthandler.dump_traceback_later(HANG_S, exit=True)
        start = time.perf_counter()
        try:
            code, got, err = _run(case, mode)
        except BaseException as e:  # anything the CLI lets out is a traceback
            code, got, err = -1, None, f"{type(e).__name__}: {e}"
        faulthandler.cancel_dump_traceback_later()
        lines = [x for x in err.splitlines() if x.strip()]
        if code == 0:
            outcome = "same" if got == baseline else "different"
        elif code == 1 and lines and "Traceback" not in err:  # a refusal, or bad records
            reported = shard and lines[0].startswith("BAD")
            outcome = "refused" if reported or len(lines) <= 2 else "traceback"
        else:
            outcome = "traceback"
        ms = round(1000 * (time.perf_counter() - start), 1)
        print(
            json.dumps(
                {
                    "case": i,
                    "file": name,
                    "damage": damage,
                    "outcome": outcome,
                    "code": code,
                    "ms": ms,
                    "error": err[-1500:],
                }
            ),
            flush=True,
        )


def main() -> None:
    sys.path.insert(0, str(REPO))
    faulthandler.enable()
    _worker(Path(sys.argv[1]), Path(sys.argv[2]), (sys.argv[3:] or ["generate"])[0])


# ----------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    """A tiny vault with a tokenizer and templates, used once so stats/ holds its files."""
    from smoe.synth import synthesize
    from smoe.vault.convert import ConvertOptions, convert

    root = tmp_path_factory.mktemp("filefuzz")
    src = synthesize(root / "src", arch="qwen3_moe", preset="tiny", seed=30)
    v = convert(src, root / "v", ConvertOptions(dtype="float32"))
    for _ in range(1):  # a run writes stats/ (the popularity counts)
        code, _, err = _cli(["generate", str(v.path), "--prompt-ids", PROMPT, "--max-tokens", "2"])
        assert code == 0, err
    remember_backbone(v.path)
    return v.path


def remember_backbone(folder: Path) -> None:
    """Hash ``folder``'s backbone and write its memo (stats/backbone-verified.json) now,
    whatever the clock says. A run writes the memo only once the file is 2 s old
    (format._RACY_NS), so without this whether the worker's undamaged run wrote it, and
    so which files the fuzz damages, depended on how loaded the machine was (issue 49:
    the shard fuzz saw the memo appear after its file list was taken)."""
    import smoe.vault.format as fmt

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fmt, "_RACY_NS", 0)  # the window a clock would decide: closed
        assert fmt.Vault.open(folder).verify_backbone()
    assert (folder / "stats" / fmt.BACKBONE_MEMO).is_file()


def run_fuzzer(folder: Path, work: Path, *extra: str) -> list[dict[str, Any]]:
    """Run the worker; fail naming the case if it crashed or hung; return its results."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, __file__, str(folder), str(work), *extra],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=900,
    )
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    started = [x for x in lines if "start" in x]
    last = f"{started[-1]['file']}: {started[-1]['damage']}" if started else "setup"
    hung = "Timeout (" in proc.stderr
    assert proc.returncode == 0, (
        f"the fuzz worker {'hung' if hung else 'crashed'} (exit {proc.returncode}) at {last}:\n"
        + proc.stderr[-3000:]
    )
    return [x for x in lines if "outcome" in x]


def _judge(results: list[dict[str, Any]], files: list[str]) -> Counter[str]:
    failures = [r for r in results if r["outcome"] in ("traceback", "different")]
    assert not failures, "\n".join(
        f"{r['file']}: {r['damage']}: {r['outcome']} (exit {r['code']})\n{r['error']}"
        for r in failures[:8]
    )
    assert {r["file"] for r in results} == set(files)
    assert len(results) == len(files) * len(DAMAGES)
    outcomes = Counter(r["outcome"] for r in results)
    print(f"\nfile fuzz outcomes: {dict(outcomes)} over {len(files)} files")
    return outcomes


def test_every_file_of_a_vault_damaged(vault, tmp_path):
    """Each file the vault holds (stats/ included), each damage: our one-line error, or
    the undamaged vault's tokens (a file the run does not need, or bytes it does not
    read). What the model computes with is checksummed, so a flip is never silent."""
    mine = shutil.copytree(vault, tmp_path / "v")
    results = run_fuzzer(mine, tmp_path / "work")
    files = files_of(mine)  # as the worker found them, after its undamaged run
    assert {"manifest.json", "config.json", "experts.bin", "backbone.safetensors"} <= set(files)
    assert {"tokenizer.json", "stats/popularity.npz"} <= set(files), files
    outcomes = _judge(results, files)
    assert outcomes["refused"] >= len(files) * 3, outcomes


def test_every_file_of_a_vault_damaged_then_exported(vault, tmp_path):
    """`smoe export` of each damaged vault: refused in one line with nothing written, or
    the undamaged vault's export byte for byte (mlx-lm then loads what the vault holds)."""
    mine = shutil.copytree(vault, tmp_path / "v")
    results = run_fuzzer(mine, tmp_path / "work", "export")
    files = files_of(mine)
    outcomes = _judge(results, files)
    assert outcomes["refused"] >= len(files) * 2, outcomes


def test_every_file_of_a_shard_damaged(vault, tmp_path):
    """The same for each file of rank 0's shard (`smoe shard`), checked by `smoe inspect
    --verify`, what a user runs before sending shards to other hosts."""
    shard = tmp_path / "shard"
    code, _, err = _cli(["shard", str(vault), str(shard), "--ranks", "2", "--rank", "0"])
    assert code == 0, err
    remember_backbone(shard)  # the memo is one of the files, however slow the machine
    files = files_of(shard)
    assert "stats/backbone-verified.json" in files, files
    outcomes = _judge(run_fuzzer(shard, tmp_path / "work", "shard"), files)
    assert outcomes["refused"] >= len(files) * 3, outcomes


if __name__ == "__main__":
    main()
