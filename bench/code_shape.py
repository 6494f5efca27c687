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


GROUP_MODULES = {
    "smoe/engine/build.py",
    "smoe/engine/group.py",
    "smoe/engine/ranks.py",
    "smoe/engine/mirror.py",
}


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


def _engine_surface(core: str) -> dict[str, int]:
    """``Engine``'s lines and public names: its methods and properties, and the
    attributes ``__init__`` sets, that do not start with an underscore."""
    for node in ast.walk(ast.parse(core)):
        if isinstance(node, ast.ClassDef) and node.name == "Engine":
            names = {
                n.name
                for n in node.body
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                and not n.name.startswith("_")
            }
            names |= {
                n.attr
                for n in ast.walk(node)
                if isinstance(n, ast.Attribute)
                and isinstance(n.ctx, ast.Store)
                and isinstance(n.value, ast.Name)
                and n.value.id == "self"
                and not n.attr.startswith("_")
            }
            return {"lines": node.end_lineno - node.lineno + 1, "public_names": len(names)}
    return {"lines": 0, "public_names": 0}


def _module_name(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _run_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement outside ``if TYPE_CHECKING:`` blocks."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found


def _import_circles(files: dict[str, str]) -> list[list[str]]:
    """Cycles among smoe's modules through the imports they run (at module level or inside
    a function, which is how a cycle is usually dodged; not those under ``if
    TYPE_CHECKING``): each strongly connected group of two or more modules."""
    known = {_module_name(n) for n in files}
    graph: dict[str, set[str]] = {m: set() for m in known}
    for name, text in files.items():
        me = _module_name(name)
        for node in _run_imports(ast.parse(text)):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from package import submodule`` depends on the submodule, not on what
                # the package's __init__ imports.
                subs = [f"{node.module}.{a.name}" for a in node.names]
                names = [a for a in subs if a not in known]
                targets = [a for a in subs if a in known] + ([node.module] if names else [])
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[me] |= {t for t in targets if t in known and t != me}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups)


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
        "engine": _engine_surface(core.get("smoe/engine/core.py", "")),
        # One process or ranks asked about outside the modules that build and are the
        # group (engine/build.py chooses, engine/group.py, ranks.py and mirror.py are it).
        "rank_branches_outside_the_group": _count(
            {n: t for n, t in smoe.items() if n not in GROUP_MODULES},
            r"(?:ranks|coordinator|leader) is (?:not )?None|(?<![\w.])engine\.ranks\b",
        ),
        "modules_over_500_lines": sorted(
            f"{n} ({t.count(chr(10))})" for n, t in smoe.items() if t.count("\n") > 500
        ),
        "import_circles": _import_circles(smoe),
        # Where a size given by the user is parsed from text (util/sizes defines it).
        "size_parse_sites": sorted(
            n
            for n, t in smoe.items()
            if n != "smoe/util/sizes.py" and re.search(r"\bparse_size\(", t)
        ),
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
