"""results/README.md is the index of the benchmark output in results/: one table row per
file, in the section of the machine it ran on, with the command, the commit that added the
file and the pages that cite it (issue 29). These tests keep the index and the folder in
step, and every results/ path the docs name pointing at a file that exists. Fast: text,
JSON and one `git cat-file`; no MLX."""

from __future__ import annotations

import fnmatch
import functools
import json
import re
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"
INDEX = RESULTS / "README.md"

# A table's section heading starts with one of these; its rows must live in that folder.
SECTIONS = {"## CPU": "cpu", "## GPU": "gpu", "## Routing archives": "archives"}
ROW = re.compile(
    r"^\|\s*\[(?P<name>[^\]]+)\]\((?P<path>[^)]+)\)\s*\|\s*(?P<command>.*?)\s*"
    r"\|\s*(?P<added>[^|]*?)\s*\|\s*(?P<cited>[^|]*?)\s*\|\s*$"
)
HEX = re.compile(r"^[0-9a-f]{7,40}$")
PROVENANCE = ("command", "commit")  # what smoe/util/provenance.py `stamp` puts on a report
# A commit cannot hold its own hash: the row of a file it adds says this until the next.
PENDING = "this commit"
NO_COMMAND = {"", "-", "?", "todo", "tbd", "unknown", PENDING}


@dataclass(frozen=True)
class Row:
    line: int
    section: str | None  # the folder the row's section is for
    name: str
    path: str  # relative to results/
    command: str
    added: str
    cited: str


@functools.cache
def rows() -> tuple[Row, ...]:
    found: list[Row] = []
    section = None
    for number, text in enumerate(INDEX.read_text().splitlines(), start=1):
        if text.startswith("## "):
            section = next((d for h, d in SECTIONS.items() if text.startswith(h)), None)
            continue
        if not re.match(r"\|\s*\[", text):
            continue
        m = ROW.match(text)
        assert m, (
            f"results/README.md:{number}: a table row that does not read as "
            f"'| [name](dir/file) | command | added in | cited by |': {text[:100]!r}"
        )
        found.append(Row(number, section, **m.groupdict()))
    return tuple(found)


def result_files() -> list[str]:
    return sorted(
        p.relative_to(RESULTS).as_posix()
        for p in RESULTS.rglob("*")
        if p.is_file() and p != INDEX and not p.name.startswith(".")
    )


def test_the_index_has_rows():
    assert len(rows()) > 50, "results/README.md: its tables read as (nearly) empty"


def test_every_file_in_results_has_exactly_one_row():
    listed = Counter(r.path for r in rows())
    missing = [f for f in result_files() if f not in listed]
    assert not missing, (
        f"results/{missing[0]} (and {len(missing) - 1} more: {missing[1:]}) has no row in "
        "results/README.md: add '| [name](dir/name) | command | added in | cited by |' "
        "to the section of the machine it ran on"
    )
    twice = sorted(p for p, n in listed.items() if n > 1)
    assert not twice, f"results/{twice[0]} has more than one row in results/README.md: keep one"


def test_every_row_names_a_file_that_exists():
    stale = [r for r in rows() if not (RESULTS / r.path).is_file()]
    assert not stale, (
        f"results/README.md:{stale[0].line} names results/{stale[0].path}, which does not "
        f"exist (and {len(stale) - 1} more): fix the path or drop the row"
    )
    renamed = [r for r in rows() if r.name != Path(r.path).name]
    assert not renamed, (
        f"results/README.md:{renamed[0].line}: the link text {renamed[0].name!r} is not the "
        f"file's name {Path(renamed[0].path).name!r}: make them the same"
    )


def test_every_row_is_in_its_machines_section():
    wrong = [r for r in rows() if r.path.split("/")[0] != r.section]
    assert not wrong, (
        f"results/README.md:{wrong[0].line}: results/{wrong[0].path} sits under the section "
        f"for {wrong[0].section}/ (and {len(wrong) - 1} more): move the row to the section "
        f"of the machine it ran on ({', '.join(SECTIONS)})"
    )


def git(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], input=stdin, capture_output=True, text=True, timeout=60
    )


def git_checkout_or_skip() -> None:
    try:
        inside = git("rev-parse", "--is-inside-work-tree", "--is-shallow-repository")
    except (OSError, subprocess.SubprocessError):
        pytest.skip("git is not available")
    answer = inside.stdout.split()
    if inside.returncode != 0 or answer[:1] != ["true"]:
        pytest.skip("not a git checkout: the hashes cannot be looked up")
    if answer[1:2] == ["true"]:
        pytest.skip("a shallow clone: old commits are not in it")


def pending(rows_: list[Row]) -> set[str]:
    """The paths among ``rows_`` whose commit cannot be named yet: not in HEAD (the change
    that adds them is not committed), or added by HEAD itself (a commit cannot hold its own
    hash). Their rows may say "this commit" until the next commit writes the hash."""
    if not rows_:
        return set()
    in_head = set(git("ls-tree", "-r", "--name-only", "HEAD", "--", "results").stdout.split())
    by_head = set(
        git(
            "diff-tree", "--no-commit-id", "--name-only", "--diff-filter=A", "-r", "--root", "HEAD"
        ).stdout.split()
    )
    return {
        r.path
        for r in rows_
        if f"results/{r.path}" not in in_head or f"results/{r.path}" in by_head
    }


def first_added(path: str) -> str | None:
    """The commit that first added ``results/<path>``, through the renames that brought it
    here (docs/ -> results/ in 63b34da) without ``--follow``, whose similarity guess can
    land on a look-alike file's history."""
    path = f"results/{path}"
    for _ in range(10):
        hashes = git("log", "--diff-filter=A", "--format=%h", "--", path).stdout.split()
        if not hashes:
            return None
        renames = git("show", "-M", "--name-status", "--format=", hashes[-1]).stdout
        old = next(
            (
                cols[1]
                for cols in (line.split("\t") for line in renames.splitlines())
                if cols[0].startswith("R") and len(cols) == 3 and cols[2] == path
            ),
            None,
        )
        if old is None:
            return hashes[-1]
        path = old
    return None


def fix_added(path: str) -> str:
    """Where the hash comes from, and the hash itself where git can say it."""
    how = f" from `git log --diff-filter=A --format=%h -- results/{path}` (or its docs/ path)"
    try:
        found = first_added(path)
    except (OSError, subprocess.SubprocessError):
        return how
    return how + (f": {found}" if found else ", once the file is committed")


def test_every_added_in_is_a_commit_git_knows():
    bad = [r for r in rows() if not HEX.match(r.added)]
    placeholder = [r for r in bad if r.added == PENDING]
    if placeholder:
        git_checkout_or_skip()
        allowed = pending(placeholder)
        bad = [r for r in bad if r.path not in allowed]
    assert not bad, (
        f"results/README.md:{bad[0].line}: 'added in' for results/{bad[0].path} is "
        f"{bad[0].added!r}, not a commit hash (and {len(bad) - 1} more): put the short hash"
        + fix_added(bad[0].path)
    )
    git_checkout_or_skip()
    hashes = sorted({r.added for r in rows() if HEX.match(r.added)})
    checked = git(
        "cat-file",
        "--batch-check=%(objecttype)",
        stdin="".join(f"{h}^{{commit}}\n" for h in hashes),
    )
    answers = checked.stdout.splitlines()
    assert len(answers) == len(hashes), checked.stderr
    unknown = {h for h, a in zip(hashes, answers, strict=True) if a != "commit"}
    where = [r for r in rows() if r.added in unknown]
    assert not where, (
        f"results/README.md:{where[0].line}: 'added in' {where[0].added} for "
        f"results/{where[0].path} is not a commit of this repository (and {len(where) - 1} "
        "more): put the short hash" + fix_added(where[0].path)
    )


def carries_provenance(path: Path) -> bool:
    """Whether a JSON report (or every line of a JSON-lines file) has its own command and
    commit, as `stamp` writes them."""
    try:
        if path.suffix == ".jsonl":
            records = [json.loads(s) for s in path.read_text().splitlines() if s.strip()]
        elif path.suffix == ".json":
            records = [json.loads(path.read_text())]
        else:
            return False
    except (ValueError, UnicodeDecodeError):
        return False
    return bool(records) and all(
        isinstance(r, dict) and all(r.get(k) for k in PROVENANCE) for r in records
    )


def test_every_file_has_its_command_in_itself_or_in_its_row():
    unknown = [
        r
        for r in rows()
        if r.command.strip().strip("`").lower() in NO_COMMAND
        and (RESULTS / r.path).is_file()
        and not carries_provenance(RESULTS / r.path)
    ]
    assert not unknown, (
        f"results/README.md:{unknown[0].line}: results/{unknown[0].path} carries no "
        f"{' and '.join(PROVENANCE)} of its own and its row gives no command (and "
        f"{len(unknown) - 1} more): write the command in the row, read back from the file's "
        "fields (run, command, args) or the docs page that cites it, with '(read back from "
        "the file)'"
    )


# A results/ path in prose, a link or a code span: `../results/cpu/x.json`, `results/gpu/`,
# `results/cpu/bench-decode-demo*.json`, `results/gpu/distributed-exact-gpu-{16bit,4bit}.json`.
MENTION = re.compile(r"(?<![\w-])results/[\w./*{},-]*")


def expand(pattern: str) -> list[str]:
    """`a-{x,y}.json` -> [`a-x.json`, `a-y.json`]; anything else as it is."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [
        out
        for alt in m.group(1).split(",")
        for out in expand(pattern[: m.start()] + alt + pattern[m.end() :])
    ]


def pages() -> list[Path]:
    return [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]


def test_every_results_path_the_docs_name_exists():
    files = result_files()
    broken = []
    for page in pages():
        for number, text in enumerate(page.read_text().splitlines(), start=1):
            for m in MENTION.finditer(text):
                mention = m.group(0).rstrip(".,")
                for path in expand(mention):
                    rel = path.removeprefix("results/").rstrip("/")
                    if "*" in rel:
                        ok = any(fnmatch.fnmatch(f, rel) for f in files)
                    else:
                        ok = (RESULTS / rel).exists() if rel else True
                    if not ok:
                        broken.append(f"{page.relative_to(ROOT)}:{number}: {mention}")
    assert not broken, (
        f"{broken[0]} names a results/ path that does not exist (and {len(broken) - 1} "
        f"more: {broken[1:]}): point it at the file under results/cpu, results/gpu or "
        "results/archives, or add the file"
    )


def test_every_page_the_index_cites_exists():
    missing = [
        (r, page)
        for r in rows()
        for page in re.findall(r"\]\(\.\./([^)]+)\)", r.cited)
        if not (ROOT / page).is_file()
    ]
    assert not missing, (
        f"results/README.md:{missing[0][0].line}: 'cited by' for results/{missing[0][0].path} "
        f"links {missing[0][1]}, which does not exist: list the pages that name the file "
        "(grep docs/ and README.md for its name), or '-'"
    )
