"""Run one `smoe` benchmark command from two commits, alternating, in one run (JSON out).

    python bench/compare_commits.py OLD_COMMIT --rounds 3 -- bench decode V --budgets 25%

The old commit is checked out into a temporary git worktree and run with PYTHONPATH
pointing at it, with S-MoE's compiled CPU kernels (this tree's where their sources match,
else built there); the new side is this working tree. Rounds alternate old/new and new/old
(ABBA), so drift in the machine hits both alike. ``--metric`` names the figures to pull
from each run's JSON (dotted paths; ``runs.*.decode_tok_s`` takes a list); the report
gives every round's values and the median ratio new / old per figure.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import harness

ROOT = harness.REPO


def pick(report: Any, path: str) -> list[float]:
    """Values at a dotted ``path`` of ``report``; ``*`` maps over a list."""
    values = [report]
    for part in path.split("."):
        nxt = []
        for v in values:
            if part == "*":
                nxt.extend(v)
            else:
                nxt.append(v[int(part)] if isinstance(v, list) else v[part])
        values = nxt
    return [float(v) for v in values]


def give_native_kernels(old_tree: Path, old: str) -> None:
    """The old side computes with S-MoE's CPU kernels too (a built extension is not in
    git): this tree's build where the kernels' sources match, else one built there."""
    same = subprocess.run(
        ["git", "diff", "--quiet", old, "--", "csrc", "setup.py"], cwd=ROOT, check=False
    )
    if same.returncode == 0:
        for built in (ROOT / "smoe").glob("_*.so"):
            shutil.copy2(built, old_tree / "smoe" / built.name)
        return
    subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=old_tree,
        check=True,
        capture_output=True,
    )


def run_side(tree: Path, args: list[str]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(
        [sys.executable, "-m", "smoe.cli", *args],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"{tree}: smoe {' '.join(args)} failed:\n{out.stderr[-2000:]}")
    start = out.stdout.index("{")
    return json.JSONDecoder().raw_decode(out.stdout[start:])[0]


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("old", help="the commit to compare with")
    harness.rounds(ap, default=2)
    ap.add_argument("--metric", action="append", required=True, help="dotted path, repeatable")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])  # first, so that --help answers
    if cut == len(argv):
        ap.error("give the smoe arguments after --")
    command = argv[cut + 1 :]
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = Path(tmp) / "old"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(old_tree), a.old],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            give_native_kernels(old_tree, a.old)
            values: dict[str, dict[str, list[list[float]]]] = {
                m: {"old": [], "new": []} for m in a.metric
            }
            for r in range(a.rounds):
                order = [("old", old_tree), ("new", ROOT)]
                for side, tree in order if r % 2 == 0 else order[::-1]:
                    report = run_side(tree, command)
                    for m in a.metric:
                        values[m][side].append(pick(report, m))
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT, check=False
            )
    result: dict[str, Any] = {"old": a.old, "command": command, "rounds": a.rounds}
    for m, sides in values.items():
        ratios = [
            n / o
            for new_run, old_run in zip(sides["new"], sides["old"], strict=True)
            for n, o in zip(new_run, old_run, strict=True)
            if o
        ]
        result[m] = sides | {"median_ratio_new_over_old": round(statistics.median(ratios), 3)}
    harness.report(result, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
