"""Exit codes as other command-line tools have them (issue 51): 2 for a command line
argparse refuses (with the command's usage), 1 for a run that could not be done, whether
`generate` refuses a budget or `plan` says it does not fit."""

from __future__ import annotations

import pytest

from smoe.chat.demo import demo_vault


def test_a_budget_refusal_exits_1_in_generate_as_in_plan(run_cli):
    vault = str(demo_vault())
    code, out, err = run_cli("generate", vault, "--prompt-ids", "5,6", "--memory", "1MB")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and out == "" and len(lines) == 1 and "Traceback" not in err
    assert "the smallest that works is --memory" in lines[0]
    code, out, _ = run_cli("plan", vault, "--memory", "1MB", "--no-compute")
    assert code == 1 and "does not fit" in out


def test_a_command_line_argparse_refuses_exits_2(run_cli, capsys):
    with pytest.raises(SystemExit) as done:
        run_cli("generate", str(demo_vault()), "--max-tokens", "many")
    assert done.value.code == 2
    assert capsys.readouterr().err.startswith("usage: smoe generate ")
