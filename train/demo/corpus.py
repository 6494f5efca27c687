"""The demo model's training text: the King James Bible, as Debian's `bible-kjv-text` ships it.

The text's copyright has expired (the translation dates from 1611); the package's own
copyright file allows unrestricted use of its data (see train/demo/README.md). The
package stores the text compressed for its `bible` reader, so both packages are fetched
with `apt-get download` (no root needed) and the reader prints every verse.

    python -m train.demo.corpus OUT_DIR     # writes OUT_DIR/kjv.jsonl, one verse per line
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("bible-kjv-text", "bible-kjv")
# bible(1) prints "Book N" headings and "  V text" verses wrapped at 80 columns.
_HEADING = re.compile(r"^(\S.*?) (\d+)$")
_VERSE = re.compile(r"^\s+(\d+) (.*)$")


@dataclass(frozen=True)
class Verse:
    book: str
    chapter: int
    verse: int
    text: str


def fetch_text(work: Path) -> str:
    """Download and unpack the two Debian packages into ``work``; return bible(1)'s output."""
    subprocess.run(["apt-get", "download", *PACKAGES], cwd=work, check=True, capture_output=True)
    root = work / "root"
    for deb in sorted(work.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    out = subprocess.run(
        [str(root / "usr/bin/bible"), "-p", str(root / "usr/lib"), "Gen1:1-Rev22:21"],
        check=True,
        capture_output=True,
        text=True,
        env={"COLUMNS": "80"},
    )
    return out.stdout


def parse(text: str) -> list[Verse]:
    """Verses in order; a wrapped verse's lines are joined with single spaces."""
    verses: list[Verse] = []
    book, chapter = "", 0
    current: list[str] | None = None
    number = 0

    def close() -> None:
        if current is not None:
            verses.append(Verse(book, chapter, number, " ".join(current)))

    for line in text.splitlines():
        if not line.strip():
            continue
        if (m := _HEADING.match(line)) and not line.startswith(" "):
            close()
            current = None
            book, chapter = m.group(1), int(m.group(2))
        elif m := _VERSE.match(line):
            close()
            number, current = int(m.group(1)), [m.group(2).strip()]
        elif current is not None:
            current.append(line.strip())
        else:
            raise ValueError(f"unexpected line in bible(1) output: {line!r}")
    close()
    return verses


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        verses = parse(fetch_text(Path(work)))
    if len(verses) != 31102:  # the KJV's verse count: anything else is a parsing fault
        raise SystemExit(f"parsed {len(verses)} verses, expected 31102")
    with open(out / "kjv.jsonl", "w", encoding="utf-8") as f:
        for v in verses:
            f.write(json.dumps(v.__dict__) + "\n")
    print(f"{len(verses)} verses -> {out / 'kjv.jsonl'}")


if __name__ == "__main__":
    main(*sys.argv[1:])
