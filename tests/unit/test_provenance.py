"""Every benchmark report carries where it came from (smoe/util/provenance.py): the command
as typed, the commit, the machine and the date; a report's own fields are kept."""

from __future__ import annotations

import json
import re

from smoe.util.provenance import commit, stamp


def test_a_report_is_stamped_with_command_commit_machine_and_date():
    out = stamp({"benchmark": "x", "runs": []}, ["smoe", "bench", "io", "V", "--workers", "1,4"])
    assert out["benchmark"] == "x" and out["runs"] == []
    assert out["command"] == "smoe bench io V --workers 1,4"
    assert out["machine"]["cores"] >= 1 and out["machine"]["cpu"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", out["date"])
    assert out["commit"] == commit()  # this checkout's (None outside one)
    json.dumps(out)  # JSON as it is printed


def test_fields_a_report_has_are_its_own():
    out = stamp({"command": "as recorded", "machine": "the lease's"}, ["smoe", "bench"])
    assert out["command"] == "as recorded" and out["machine"] == "the lease's"


def test_smoe_bench_prints_a_stamped_report(run_cli, tmp_path):
    from tests.conftest import tiny_vault

    vault = tiny_vault(tmp_path, seed=2)
    code, out, err = run_cli("bench", "io", vault.path, "--workers", "1", "--reads", "8")
    assert code == 0, err
    report = json.loads(out)
    assert report["command"].startswith("smoe bench io") and "machine" in report
