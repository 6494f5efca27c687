"""docs/architecture.md's module map names every module under smoe/ exactly once, with a line
saying what it does, as tests/unit/test_results_index.py keeps results/ and its index in
step (issue 52). A module is every ``smoe/**/*.py`` but ``__init__.py``: a package's
``__init__.py`` is described by its package's heading in the map, and every package has
one. Fast: text only, no import of smoe."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMOE = ROOT / "smoe"
DOC = ROOT / "docs" / "architecture.md"
START, END = "<!-- module-map:start -->", "<!-- module-map:end -->"

# A row: | `smoe/pkg/module.py` | what it does |
ROW = re.compile(r"^\|\s*`(?P<path>smoe/[\w/]+\.py)`\s*\|\s*(?P<what>.*?)\s*\|\s*$")
# A package's heading: #### `smoe/pkg/`: what it is
HEADING = re.compile(r"^#{2,6}\s*`(?P<package>smoe/(?:[\w/]+/)?)`\s*:?\s*(?P<what>.*)$")
FIX = (
    "docs/architecture.md, 'Module map': add a row '| `{path}` | what it does |' to the "
    "table of its package (between the module-map markers)"
)


def map_text() -> str:
    text = DOC.read_text()
    assert START in text and END in text, (
        f"docs/architecture.md has lost its module map's markers ({START} ... {END}): put "
        "them back around the map"
    )
    return text.split(START, 1)[1].split(END, 1)[0]


def rows() -> list[tuple[int, str, str]]:
    """(line in the map, module path, its line) for every table row of the map."""
    found = []
    for number, line in enumerate(map_text().splitlines(), start=1):
        m = ROW.match(line)
        if m:
            found.append((number, m.group("path"), m.group("what")))
        else:
            assert not re.match(r"^\|\s*`smoe/", line), (
                f"module map line {number} does not read as '| `smoe/...py` | what it does "
                f"|': {line[:100]!r}"
            )
    return found


def headings() -> list[str]:
    return [m.group("package") for line in map_text().splitlines() if (m := HEADING.match(line))]


def modules() -> list[str]:
    return sorted(
        p.relative_to(ROOT).as_posix() for p in SMOE.rglob("*.py") if p.name != "__init__.py"
    )


def packages() -> list[str]:
    return sorted(f"{p.parent.relative_to(ROOT).as_posix()}/" for p in SMOE.rglob("__init__.py"))


def test_the_map_has_rows():
    assert len(rows()) > 100, "docs/architecture.md's module map reads as (nearly) empty"


def test_every_module_is_in_the_map():
    named = {path for _, path, _ in rows()}
    missing = [m for m in modules() if m not in named]
    assert not missing, (
        f"{missing[0]} (and {len(missing) - 1} more: {missing[1:]}) is not in "
        + FIX.format(path=missing[0])
    )


def test_no_module_is_named_twice():
    twice = sorted(p for p, n in Counter(path for _, path, _ in rows()).items() if n > 1)
    assert not twice, (
        f"{twice} appear more than once in docs/architecture.md's module map: keep one row each"
    )


def test_the_map_names_no_module_that_is_gone():
    gone = [(n, path) for n, path, _ in rows() if not (ROOT / path).is_file()]
    assert not gone, (
        f"docs/architecture.md's module map names {gone[0][1]} (and {len(gone) - 1} more: "
        f"{[p for _, p in gone[1:]]}), which is not in smoe/: drop its row, or rename it to "
        "the module that now does that job"
    )


def test_each_row_says_what_the_module_does():
    empty = [path for _, path, what in rows() if len(what.split()) < 2]
    assert not empty, f"{empty}: give each of these rows a line saying what the module does"


def test_each_module_sits_under_its_packages_heading():
    """A row belongs to the table under its own package's heading."""
    current, misplaced = None, []
    for line in map_text().splitlines():
        if m := HEADING.match(line):
            current = m.group("package")
        elif m := ROW.match(line):
            package = m.group("path").rsplit("/", 1)[0] + "/"
            if package != current:
                misplaced.append((m.group("path"), current))
    assert not misplaced, (
        f"{misplaced[0][0]} sits under the heading of {misplaced[0][1]}: move its row to the "
        f"table under '#### `{misplaced[0][0].rsplit('/', 1)[0]}/`' (and {len(misplaced) - 1} "
        "more)"
    )


def test_every_package_has_a_heading_once():
    named = Counter(headings())
    missing = [p for p in packages() if p not in named]
    assert not missing, (
        f"package {missing[0]} has no heading in docs/architecture.md's module map: add "
        f"'#### `{missing[0]}`: what it is' with a table of its modules (and "
        f"{len(missing) - 1} more: {missing[1:]})"
    )
    twice = [p for p, n in named.items() if n > 1]
    assert not twice, f"{twice} have more than one heading in the module map: keep one"
    gone = [p for p in named if p not in packages()]
    assert not gone, f"the module map has headings for {gone}, which are not packages in smoe/"
