"""The shape of smoe/'s code at one or more commits, read with ast from git (no checkout):
the largest classes and functions (lines), the variant branches spread through the code
(``ranks is not None``, ``isinstance(..., Source)``, ``hasattr`` in the engine), the
engine's project imports, and how often the tests reach a private attribute of an engine
part (``engine._x``, ``.debug.``). JSON out. docs/architecture.md quotes it.

    python bench/code_shape.py 9d973a1 HEAD [--top 8]
"""

from __future__ import annotations

import ast
import re
import subprocess

import harness

REPO = harness.REPO

PARTS = r"\b(?:engine|eng|e|plain|betting)\.(?:_\w+|scheduler|ring|batcher|runner|compute|tracer|reader)\b"


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout


def _files(rev: str, folder: str) -> dict[str, str]:
    names = _git("ls-tree", "-r", "--name-only", rev, folder).split()
    return {n: _git("show", f"{rev}:{n}") for n in names if n.endswith(".py")}


def _sizes(files: dict[str, str]) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    classes, functions = [], []
    for name, text in files.items():
        for node in ast.walk(ast.parse(text)):
            span = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef):
                classes.append((span, f"{name}:{node.name}"))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                functions.append((span, f"{name}:{node.name}"))
    return sorted(classes, reverse=True), sorted(functions, reverse=True)


def _count(files: dict[str, str], pattern: str) -> int:
    return sum(len(re.findall(pattern, t)) for t in files.values())


def shape(rev: str, top: int) -> dict[str, object]:
    smoe, tests = _files(rev, "smoe"), _files(rev, "tests")
    classes, functions = _sizes(smoe)
    core = {n: t for n, t in smoe.items() if n == "smoe/engine/core.py"}
    core_imports = {
        m.group(1) for t in core.values() for m in re.finditer(r"from (smoe\.[\w.]+) import", t)
    }
    return {
        "commit": _git("rev-parse", "--short", rev).strip(),
        "largest_classes": [{"lines": n, "name": c} for n, c in classes[:top]],
        "largest_functions": [{"lines": n, "name": f} for n, f in functions[:top]],
        "branches": {
            "ranks is (not) None": _count(smoe, r"ranks is (?:not )?None"),
            "modules branching on drafting": sum(
                bool(re.search(r"if [^\n]*drafting", t)) for t in smoe.values()
            ),
            "isinstance(..., Source)": _count(smoe, r"isinstance\([^)]*Source\)"),
            "hasattr in engine/core.py": _count(core, r"\bhasattr\("),
        },
        "engine_core_project_imports": len(core_imports),
        # An engine's parts used by tests: straight (engine.ring) or through engine.debug.
        "tests_reaching_engine_parts": _count(tests, PARTS),
        "tests_through_engine_debug": _count(tests, r"\.debug\."),
        "modules": len(smoe),
        "lines": sum(t.count("\n") for t in smoe.values()),
    }


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("revs", nargs="+", help="commits to read (e.g. 9d973a1 HEAD)")
    p.add_argument("--top", type=int, default=8, help="largest classes and functions listed")
    a = p.parse_args()
    harness.report({"shapes": [shape(r, a.top) for r in a.revs]}, a)


if __name__ == "__main__":
    main()
