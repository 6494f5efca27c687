"""bench/harness.py, the bench/ scripts' shared arguments and their one way to finish: the
flags are spelled and explained once, --out writes the stamped report atomically, and
every script still answers --help (documented commands keep working)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import harness

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name != "harness.py")
PROVENANCE = {"command", "commit", "machine", "date"}

# Every script's --help in one child process (a process each would import MLX and torch
# 28 times, over half a minute); bench/ first on sys.path, as `python bench/X.py` has it.
HELP_ALL = """
import contextlib, io, json, runpy, sys
bench, scripts, result = sys.argv[1], sys.argv[2:], {}
sys.path.insert(0, bench)
for path in scripts:
    sys.argv = [path, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code or 0
    result[path] = [code, out.getvalue()]
print(json.dumps(result))
"""


def _parser() -> argparse.ArgumentParser:
    p = harness.parser("doc")
    harness.vault(p)
    harness.memory(p, ring=True, default="100%")
    harness.device(p)
    harness.rounds(p, default=3)
    harness.workers(p, default=4)
    return p


def test_the_shared_arguments_have_one_spelling_and_keep_the_scripts_defaults():
    a = _parser().parse_args(["V"])
    assert (a.vault, a.memory, a.device, a.rounds, a.workers, a.json_out) == (
        "V",
        "100%",
        None,
        3,
        4,
        None,
    )
    a = _parser().parse_args(
        ["V", "--memory", "25%", "--device", "gpu", "--rounds", "2", "--workers", "8"]
    )
    assert (a.memory, a.device, a.rounds, a.workers) == ("25%", "gpu", 2, 8)
    assert _parser().parse_args(["V", "--out", "r.json"]).json_out == Path("r.json")
    with pytest.raises(SystemExit):
        _parser().parse_args(["V", "--device", "tpu"])
    p = harness.parser()
    harness.vault(p, demo=True)  # optional: the script falls back to the demo's vault
    harness.memory(p, type=float, action="append", required=True)
    a = p.parse_args(["--memory", "2e9", "--memory", "3e9"])
    assert a.vault is None and a.memory == [2e9, 3e9]
    assert "(repeatable)" in p.format_help()


def test_report_prints_indented_json_with_its_provenance(capsys):
    out = harness.report({"benchmark": "x", "runs": [1]}, argparse.Namespace(json_out=None))
    printed = capsys.readouterr().out
    assert json.loads(printed) == out and printed.startswith("{\n ")
    assert out["benchmark"] == "x" and out.keys() >= PROVENANCE


def test_out_writes_the_report_atomically(tmp_path, monkeypatch, capsys):
    target = tmp_path / "reports" / "r.json"  # the folder is made
    renames = []
    replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renames.append((a, b)), replace(a, b)))
    harness.report({"benchmark": "x"}, argparse.Namespace(json_out=target))
    assert capsys.readouterr().out == ""
    report = json.loads(target.read_text())
    assert report["benchmark"] == "x" and report.keys() >= PROVENANCE
    # written under a temporary name beside it, then renamed over it
    assert [(Path(a).parent, Path(b)) for a, b in renames] == [(target.parent, target)]
    assert Path(renames[0][0]).name != target.name
    # a report that cannot be written leaves the last one whole and no temporary behind
    with pytest.raises(TypeError):
        harness.report({"benchmark": object()}, argparse.Namespace(json_out=target))
    assert json.loads(target.read_text()) == report
    assert [p.name for p in target.parent.iterdir()] == ["r.json"]


def test_a_script_writes_its_stamped_report_to_out(tmp_path):
    target = tmp_path / "shape.json"
    run = subprocess.run(
        [sys.executable, "bench/code_shape.py", "HEAD", "--top", "1", "--out", str(target)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == ""
    report = json.loads(target.read_text())
    assert PROVENANCE | {"shapes"} <= report.keys()
    assert report["command"].startswith("python bench/code_shape.py HEAD")


def test_every_script_answers_help_with_the_shared_spellings():
    run = subprocess.run(
        [sys.executable, "-c", HELP_ALL, str(BENCH), *map(str, SCRIPTS)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert {Path(p).name: code for p, (code, _) in result.items() if code != 0} == {}
    for path, (_, text) in result.items():
        if "import harness" not in Path(path).read_text():
            continue  # bench/io.py: `smoe bench io`'s own options
        name = Path(path).name
        assert "--out PATH" in text, name
        for flag, spelled in (("--device", "--device {cpu,gpu}"), ("--rounds", "--rounds ROUNDS")):
            assert flag not in text or spelled in text, (name, flag)
