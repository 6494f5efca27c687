"""Sizes as the commands print them (issue 28): progress bars that count bytes show bytes,
and one vault's slot size is one figure in every command."""

from __future__ import annotations

import re

import pytest

from smoe.commands.vault import bar_units


def test_synth_bar_counts_bytes_in_byte_units(run_cli, tmp_path):
    code, _, err = run_cli("synth", tmp_path / "ck")
    assert code == 0
    weights = [line for line in re.split(r"[\r\n]", err) if "synth weights" in line]
    # tqdm scales a byte count, as a download does: "504k/504k [00:00<00:00, 54.0MB/s]",
    # not "503808/503808 [00:00<00:00, 5.4e+7part/s]".
    assert weights and re.search(r"100%.*\d[kMG]/[\d.]+[kMG] .*[kMG]?B/s", weights[-1]), weights
    assert "part" not in err


@pytest.mark.parametrize(
    ("stage", "unit"),
    [("weights", "B"), ("experts", "layer"), ("records", "record"), ("backbone", "file")],
)
def test_each_stage_bar_names_what_it_counts(stage, unit):
    options = bar_units(stage)
    assert options["unit"] == unit
    # Bytes in decimal units, as format_bytes prints sizes everywhere else.
    assert options.get("unit_divisor", 1000) == 1000
    assert options.get("unit_scale", False) == (unit == "B")
