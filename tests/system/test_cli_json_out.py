"""What a script reads (issue 51): `smoe bench policy` writes JSON lines alone on stdout
(its table goes to stderr), and `smoe inspect --json` says what it looked at."""

from __future__ import annotations

import json


def test_bench_policy_stdout_is_json_lines(run_cli):
    argv = ["bench", "policy", "--preset", "qwen3-30b-like", "--tokens", "64", "--layers", "2"]
    code, out, err = run_cli(*argv, "--rings", "0.5", "--policies", "lru", "--locality")
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 2 and all(isinstance(json.loads(line), dict) for line in lines)
    assert "Belady" in err  # the table, for a person
