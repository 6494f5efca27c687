"""Sizes as the commands print them (issue 28): progress bars that count bytes show bytes,
and one vault's slot size is one figure in every command, its record's on disk another
where they differ, each named as what it is (issue 51)."""

from __future__ import annotations

import json
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


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    from smoe.synth import synthesize

    return synthesize(tmp_path_factory.mktemp("sizes") / "src", preset="tiny", seed=28)


SIZE = r"(\S+ [KMGT]?B)"


def _slot_figures(text: str) -> list[str]:
    """Every slot size a command's output states, by the words each command uses."""
    patterns = (
        rf"\(top-\d+\), {SIZE} (?:each|a slot)",  # plan
        rf"= \d+ experts x {SIZE}",  # the --memory line of plan, generate, chat, serve
    )
    return [m for p in patterns for m in re.findall(p, text)]


def _record_figures(text: str) -> list[str]:
    """Every record size (on disk) a command's output states."""
    patterns = (
        rf"expert records of {SIZE} on disk",  # convert
        rf"records +\d+ x {SIZE} on disk",  # inspect
        rf"\(top-\d+\), {SIZE} each",  # plan, where the slot is the record
        rf"a slot \({SIZE} a record on disk\)",  # plan, where they differ
    )
    return [m for p in patterns for m in re.findall(p, text)]


def test_one_vault_one_slot_size_in_every_command(source, tmp_path, run_cli, monkeypatch):
    """convert, inspect, plan and generate print the ring slot's size (the record stride a
    unified ring allocates), in format_bytes' units, where they printed the payload in some
    and the stride in others."""
    from smoe.util.sizes import format_bytes
    from smoe.vault.format import Vault

    monkeypatch.setenv("SMOE_CACHE", str(tmp_path / "cache"))  # plan's disk probe cache
    vault = tmp_path / "v"
    outputs = {}
    code, outputs["convert"], _ = run_cli("convert", source, vault, "--dtype", "float32", "--quiet")
    assert code == 0
    stride = Vault.open(vault).manifest.record.stride
    assert Vault.open(vault).manifest.record.size < stride  # payload and slot differ here
    code, outputs["inspect"], _ = run_cli("inspect", vault)
    assert code == 0
    plan = ("plan", vault, "--no-compute", "--probe-seconds", "0.2", "--memory", "400MB")
    code, outputs["plan"], _ = run_cli(*plan, "--device", "cpu")
    assert code == 0
    generate = ("generate", vault, "--prompt-ids", "1,2", "--max-tokens", "1", "--device", "cpu")
    code, _, outputs["generate"] = run_cli(*generate, "--memory", "400MB")
    assert code == 0
    for command, text in outputs.items():
        figures = _slot_figures(text) + _record_figures(text)
        assert figures and set(figures) == {format_bytes(stride)}, (command, text)
    code, out, _ = run_cli(*generate, "--json")
    assert code == 0 and json.loads(out)["stats"]["slot_bytes"] == stride


def test_a_slot_unlike_its_record_is_named_as_each(source, tmp_path, run_cli, monkeypatch):
    """bfloat16 scales on a float32 CPU: the staged ring's slot holds the record widened,
    so the slot and the record on disk are two figures, each named as what it is (a slot
    of 2.95 MB beside a record of 2.65 MB read as one size, issue 51)."""
    from smoe.util.sizes import format_bytes
    from smoe.vault.format import Vault

    monkeypatch.setenv("SMOE_CACHE", str(tmp_path / "cache"))
    vault = tmp_path / "v"
    code, converted, _ = run_cli("convert", source, vault, "--dtype", "bfloat16", "--quiet")
    assert code == 0
    record = format_bytes(Vault.open(vault).manifest.record.stride)
    code, inspected, _ = run_cli("inspect", vault)
    assert code == 0
    plan = ("plan", vault, "--no-compute", "--probe-seconds", "0.2", "--memory", "400MB")
    code, out, _ = run_cli(*plan, "--device", "cpu", "--json")
    assert code == 0 and json.loads(out)["ring"] == "staged"
    slot = format_bytes(json.loads(out)["experts"]["slot_bytes"])
    assert slot != record
    code, planned, _ = run_cli(*plan, "--device", "cpu")
    generate = ("generate", vault, "--prompt-ids", "1,2", "--max-tokens", "1", "--device", "cpu")
    code, _, started = run_cli(*generate, "--memory", "400MB")
    assert code == 0
    for text in (converted, inspected, planned):
        assert set(_record_figures(text)) == {record}, text
    for text in (planned, started):
        assert set(_slot_figures(text)) == {slot}, text
