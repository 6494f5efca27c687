"""Every package the code imports is one pyproject.toml declares: a fresh install of the
README's commands then has everything the suite and the engine import. (A test importing
scipy, which no extra installed, once kept a whole test file from being collected.)

The rules, by where the import is:
- tests/: the project's dependencies or its ``test`` extra;
- smoe/, at module level (run on ``import smoe...``): the dependencies alone;
- smoe/ inside a function, bench/ and train/: the dependencies or any extra (an optional
  feature imports its package when used, and names the extra when it is missing).
"""

from __future__ import annotations

import ast
import functools
import re
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The checkout's own top levels; harness is bench/harness.py, which bench/ scripts import.
LOCAL = {"smoe", "tests", "train", "bench", "examples", "harness"}


def normalize(name: str) -> str:
    """A distribution name in PEP 503's form (``Jinja2`` and ``jinja2`` are one)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    """``mlx[cpu]>=0.32.4; sys_platform == 'linux'`` -> ``mlx``."""
    found = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    assert found, f"unreadable requirement in pyproject.toml: {spec!r}"
    return normalize(found.group(1))


@dataclass(frozen=True)
class Declared:
    runtime: frozenset[str]
    extras: dict[str, frozenset[str]]

    @classmethod
    def read(cls, pyproject: Path) -> Declared:
        project = tomllib.loads(pyproject.read_text())["project"]
        extras = project.get("optional-dependencies", {})
        return cls(
            frozenset(map(requirement_name, project["dependencies"])),
            {k: frozenset(map(requirement_name, v)) for k, v in extras.items()},
        )

    def any_extra(self) -> frozenset[str]:
        return self.runtime.union(*self.extras.values())


@dataclass(frozen=True)
class Import:
    module: str  # the top-level name: ``mlx`` for ``import mlx.core``
    line: int
    in_function: bool


def imports_of(source: str) -> Iterator[Import]:
    """The absolute imports of third-party or stdlib top-level modules in ``source``."""
    tree = ast.parse(source)
    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            in_function.update(id(inner) for inner in ast.walk(node) if inner is not node)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            yield Import(name.split(".")[0], node.lineno, id(node) in in_function)


@functools.cache
def _distributions() -> dict[str, list[str]]:
    """Top-level module name -> the installed distributions providing it (slow: cached)."""
    return dict(packages_distributions())


def undeclared(
    source: str, allowed_at_top: frozenset[str], allowed_in_function: frozenset[str]
) -> list[str]:
    """One line per import of ``source`` whose package is not allowed where it stands."""
    distributions = _distributions()
    problems = []
    for imp in imports_of(source):
        if imp.module in sys.stdlib_module_names or imp.module in LOCAL | {"__future__"}:
            continue
        allowed = allowed_in_function if imp.in_function else allowed_at_top
        provided_by = {normalize(d) for d in distributions.get(imp.module, [])}
        if not provided_by & allowed:
            got = ", ".join(sorted(provided_by)) or "not installed"
            problems.append(f"line {imp.line}: import {imp.module} ({got})")
    return problems


def _sources(folder: str) -> Iterator[Path]:
    yield from sorted((ROOT / folder).rglob("*.py"))


def test_every_package_the_code_imports_is_declared():
    declared = Declared.read(ROOT / "pyproject.toml")
    for_tests = declared.runtime | declared.extras["test"]
    rules = {
        "tests": (for_tests, for_tests),
        "smoe": (declared.runtime, declared.any_extra()),
        "bench": (declared.any_extra(), declared.any_extra()),
        "train": (declared.any_extra(), declared.any_extra()),
    }
    problems = [
        f"{path.relative_to(ROOT)} {problem}"
        for folder, (top, inside) in rules.items()
        for path in _sources(folder)
        for problem in undeclared(path.read_text(), top, inside)
    ]
    assert not problems, "declare these in pyproject.toml:\n" + "\n".join(problems)


def test_the_guard_names_an_undeclared_import():
    """The guard itself: a package outside the allowed set is reported with its line, one
    inside a function is judged by the function's (wider) set, and the stdlib, the
    checkout's own packages and relative imports pass."""
    source = (
        "import os\nimport numpy as np\nfrom smoe.errors import SmoeError\n"
        "from . import fakes\nimport pytest\n"
        "def f():\n    import pytest\n"
    )
    assert undeclared(source, frozenset({"numpy"}), frozenset({"numpy"})) == [
        "line 5: import pytest (pytest)",
        "line 7: import pytest (pytest)",
    ]
    assert undeclared(source, frozenset({"numpy"}), frozenset({"numpy", "pytest"})) == [
        "line 5: import pytest (pytest)"
    ]
    assert undeclared("import no_such_package_here\n", frozenset(), frozenset()) == [
        "line 1: import no_such_package_here (not installed)"
    ]


def test_a_requirement_is_read_by_its_name():
    assert requirement_name("mlx[cpu]>=0.32.4; sys_platform == 'linux'") == "mlx"
    assert requirement_name("prompt_toolkit>=3.0.40,<4") == "prompt-toolkit"
    assert requirement_name("Jinja2>=3.1") == "jinja2"
