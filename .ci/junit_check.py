"""Judge a pytest JUnit report against tests/: fail unless every test file was collected and
ran, nothing failed or errored, and nothing was skipped but the GPU tests (a test that
skips on a CPU-only CI machine by design). A skip or a missing file elsewhere means a test
that never ran, which a green exit code would hide (an importorskip of a package no extra
installs, say)."""

import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

MAY_SKIP = "tests.gpu."  # needs a CUDA GPU (pytest -m gpu on the device machine)

report, tests_dir = Path(sys.argv[1]), Path(sys.argv[2])
if not report.is_file():
    sys.exit(f"CI fails: pytest wrote no report at {report} (did it start?)")
outcomes: dict[str, Counter[str]] = {}
problems = []
for case in ET.parse(report).getroot().iter("testcase"):
    # classname "tests.unit.test_x" (or "tests.unit.test_x.Class"); a collection error has
    # none and names its module in "name" instead.
    where = case.get("classname") or case.get("name", "?")
    parts = where.split(".")
    last = next((i for i, part in enumerate(parts) if part.startswith("test_")), 1)
    module = ".".join(parts[: last + 1])
    kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
    outcomes.setdefault(module, Counter())[kind] += 1
    test = f"{where}::{case.get('name')}"
    if kind in ("failure", "error"):
        problems.append(f"{kind}: {test}")
    elif kind == "skipped" and not module.startswith(MAY_SKIP):
        reason = next(c for c in case if c.tag == "skipped").get("message", "")
        problems.append(f"skipped: {test}: {reason}")

files = sorted(
    ".".join(("tests", *p.relative_to(tests_dir).with_suffix("").parts))
    for p in tests_dir.rglob("test_*.py")
)
for module in files:
    ran = outcomes.get(module, Counter())
    if not ran:
        problems.append(f"not collected: {module.replace('.', '/')}.py")
    elif not module.startswith(MAY_SKIP) and ran["passed"] == 0:
        problems.append(f"nothing passed in {module.replace('.', '/')}.py: {dict(ran)}")

total = sum(outcomes.values(), Counter())
print(
    f"junit: {len(files)} test files, {total['passed']} passed, {total['skipped']} skipped, "
    f"{total['failure']} failed, {total['error']} errors"
)
if problems:
    sys.exit("CI fails:\n  " + "\n  ".join(problems))
