"""docs/getting-started.md's table of the other tools' habits: every S-MoE line in it runs
(on a small vault for MODEL), and each greedy one prints what its long spelling prints."""

from __future__ import annotations

import io
import re
import shlex
from pathlib import Path

import pytest

from smoe.chat.demo import demo_vault

DOC = Path(__file__).resolve().parents[2] / "docs" / "getting-started.md"


def table_rows() -> list[tuple[str, str]]:
    """(tool, S-MoE line) per row between the habits markers."""
    text = DOC.read_text()
    block = text.split("<!-- habits:start -->")[1].split("<!-- habits:end -->")[0]
    rows = []
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[2].startswith("`smoe "):
            rows.append((cells[0], cells[2].strip("`")))
    return rows


# The long spelling of each greedy alias row (what it must print too).
LONG = {
    '-m MODEL -p "In the beginning" -n 8 -c 512 --temp 0': [
        "MODEL",
        "--prompt",
        "In the beginning",
        "--max-tokens",
        "8",
        "--max-context",
        "512",
        "--temp",
        "0",
    ],
}


@pytest.fixture(scope="module")
def vault() -> str:
    return str(demo_vault())


def test_the_table_has_a_line_for_each_tool():
    assert {tool for tool, _ in table_rows()} == {"mlx-lm", "llama.cpp", "ollama"}


@pytest.mark.parametrize("row", table_rows(), ids=lambda r: r[1][:48])
def test_each_s_moe_line_runs(row, vault, run_cli, monkeypatch):
    _, line = row
    argv = [vault if a == "MODEL" else a for a in shlex.split(line)[1:]]
    if argv[0] == "chat":  # piped: one message, the reply on stdout
        monkeypatch.setattr("sys.stdin", io.StringIO("Who was Moses?\n"))
    code, out, err = run_cli(*argv)
    assert code == 0, err
    if "--temp 0" in line:  # greedy: a reply (a sampled one may end at its first token)
        assert out.strip(), err
    args = re.sub(r"^smoe generate ", "", line)
    if args in LONG:
        code, long_out, err = run_cli(
            "generate", *[vault if a == "MODEL" else a for a in LONG[args]]
        )
        assert code == 0 and long_out == out, err
