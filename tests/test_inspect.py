"""smoe inspect: the summary, --json, and --verify catching a flipped byte."""

from __future__ import annotations

import json

import pytest

from smoe.vault.convert import convert
from smoe.vault.format import Vault
from smoe.vault.inspect import verify


@pytest.fixture
def vault(hf_dir, tmp_path):
    return convert(hf_dir("qwen2_moe"), tmp_path / "v")


def test_json_summary(vault, run_cli):
    code, out, _ = run_cli("inspect", vault.path, "--json")
    assert code == 0
    info = json.loads(out)
    m = vault.manifest
    assert info["topology"]["model_type"] == "qwen2_moe"
    assert info["topology"]["num_experts"] == 8 and info["topology"]["experts_per_token"] == 2
    assert info["record"]["count"] == m.num_records == 16
    assert info["record"]["size"] == m.record.size
    assert info["experts_bytes"] == vault.experts_path.stat().st_size
    assert info["backbone_bytes"] == vault.backbone_path.stat().st_size
    assert info["quantization"]["experts"]["bits"] == 4


def test_text_summary(vault, run_cli):
    code, out, _ = run_cli("inspect", vault.path)
    assert code == 0
    assert "qwen2_moe" in out and "top-2" in out and "records" in out and "backbone" in out


def test_verify_clean(vault, run_cli):
    assert verify(vault) == []
    code, out, _ = run_cli("inspect", vault.path, "--verify", "--quiet")
    assert code == 0 and "all 16 records match" in out


@pytest.mark.parametrize(("layer", "expert", "where"), [(1, 5, 0), (0, 0, -1), (1, 7, 1000)])
def test_verify_names_each_corrupt_record(vault, run_cli, layer, expert, where):
    m = vault.manifest
    offset = m.record_offset(layer, expert) + (where % m.record.size)
    with open(vault.experts_path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))
    bad = verify(Vault.open(vault.path))
    assert [(b.layer, b.expert) for b in bad] == [(layer, expert)]
    code, out, _ = run_cli("inspect", vault.path, "--verify", "--quiet")
    assert code == 1
    assert f"layer {layer}, expert {expert}" in out
    code, out, _ = run_cli("inspect", vault.path, "--verify", "--json")
    assert code == 1
    assert json.loads(out)["verify"]["bad"] == [
        {"layer": layer, "expert": expert, "index": m.record_index(layer, expert)}
    ]


def test_padding_is_not_checksummed_but_is_zero(vault):
    """Bytes between a record's end and the next record are zero padding."""
    m = vault.manifest
    data = vault.experts_path.read_bytes()
    for i in range(m.num_records):
        pad = data[i * m.record.stride + m.record.size : (i + 1) * m.record.stride]
        assert pad == bytes(len(pad))
