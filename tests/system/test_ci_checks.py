"""`.ci/run`'s own judges: the README's commands as it reads them, and the JUnit check that
fails a run where a test file was not collected or a test skipped that should have run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / ".ci" / script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_readme_opens_with_the_chat_and_the_test_command():
    done = _run("readme_commands.py", ROOT / "README.md")
    assert done.returncode == 0, done.stderr
    chat, tests = done.stdout.splitlines()
    assert chat.startswith("pip install -e .") and chat.endswith("smoe chat")
    assert tests.startswith('pip install -e ".[test]"') and "python -m pytest" in tests


def test_a_readme_without_the_commands_is_refused(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# S-MoE\n\n```bash\npip install -e .\n```\n")
    done = _run("readme_commands.py", readme)
    assert done.returncode != 0 and "chat command, then the test one" in done.stderr


def _report(tmp_path: Path, cases: str) -> Path:
    path = tmp_path / "junit.xml"
    path.write_text(f'<testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>')
    return path


def _tests_dir(tmp_path: Path, *names: str) -> Path:
    folder = tmp_path / "tests"
    folder.mkdir()
    for name in names:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("")
    return folder


def test_the_junit_check_passes_a_full_run_with_gpu_skips(tmp_path):
    tests = _tests_dir(tmp_path, "test_a.py", "gpu/test_gpu.py", "gpu/test_paths.py")
    report = _report(
        tmp_path,
        '<testcase classname="tests.test_a" name="t1"/>'
        '<testcase classname="tests.test_a.Group" name="t2"/>'
        '<testcase classname="tests.gpu.test_gpu" name="g"><skipped message="needs a CUDA GPU"/>'
        "</testcase>"
        '<testcase classname="tests.gpu.test_paths" name="p"><skipped message="needs a GPU"/>'
        "</testcase>",
    )
    done = _run("junit_check.py", report, tests)
    assert done.returncode == 0, done.stderr
    assert "3 test files, 2 passed, 2 skipped, 0 failed, 0 errors" in done.stdout


def test_the_junit_check_fails_what_a_green_exit_would_hide(tmp_path):
    tests = _tests_dir(tmp_path, "test_a.py", "test_b.py", "test_c.py", "test_d.py")
    report = _report(
        tmp_path,
        '<testcase classname="tests.test_a" name="t"><skipped message="no scipy"/></testcase>'
        '<testcase classname="" name="tests.test_b"><error message="collection failure"/>'
        "</testcase>"
        '<testcase classname="tests.test_d" name="t"><failure message="boom"/></testcase>',
    )
    done = _run("junit_check.py", report, tests)
    assert done.returncode != 0
    for needle in (
        "skipped: tests.test_a::t: no scipy",
        "error: tests.test_b::tests.test_b",
        "not collected: tests/test_c.py",
        "failure: tests.test_d::t",
        "nothing passed in tests/test_a.py",
    ):
        assert needle in done.stderr, done.stderr


def test_the_junit_check_fails_without_a_report(tmp_path):
    done = _run("junit_check.py", tmp_path / "missing.xml", _tests_dir(tmp_path, "test_a.py"))
    assert done.returncode != 0 and "wrote no report" in done.stderr
