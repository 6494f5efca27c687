"""smoe inspect: the summary, --json, and --verify catching a flipped byte in a record, its
padding, or the backbone; a manifest that lies about the layout cannot reach --verify."""

from __future__ import annotations

import json

import pytest

from smoe.vault.convert import convert
from smoe.vault.format import Vault
from smoe.vault.inspect import verify
from smoe.vault.manifest import SIGNATURE, sign_manifest


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


def test_json_names_a_download_as_what_it_is(vault, hf_dir, run_cli):
    """A checkpoint folder was reported as "format": "smoe-vault" (issue 51)."""
    code, out, _ = run_cli("inspect", hf_dir("qwen2_moe"), "--json")
    info = json.loads(out)
    assert code == 0 and info["format"] == "hf-checkpoint" and info["producer"] is None
    assert info["version"] is None and "streamed" in info
    code, out, _ = run_cli("inspect", vault.path, "--json")
    assert json.loads(out)["format"] == "smoe-vault" and json.loads(out)["version"] == 1
    assert "streamed" not in json.loads(out)


def test_text_summary(vault, run_cli):
    code, out, _ = run_cli("inspect", vault.path)
    assert code == 0
    assert "qwen2_moe" in out and "top-2" in out and "records" in out and "backbone" in out


def test_verify_clean(vault, run_cli):
    assert verify(vault) == []
    code, out, _ = run_cli("inspect", vault.path, "--verify", "--quiet")
    assert code == 0 and "all 16 records match" in out
    assert "backbone.safetensors matches its checksum" in out
    assert "config.json matches its checksum" in out


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
        {
            "layer": layer,
            "expert": expert,
            "index": m.record_index(layer, expert),
            "problems": ["checksum"],
        }
    ]


def test_padding_is_not_checksummed_but_is_zero(vault):
    """Bytes between a record's end and the next record are zero padding."""
    m = vault.manifest
    data = vault.experts_path.read_bytes()
    for i in range(m.num_records):
        pad = data[i * m.record.stride + m.record.size : (i + 1) * m.record.stride]
        assert pad == bytes(len(pad))


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("gap", ["between components", "after size"])
def test_verify_reports_a_flipped_padding_byte(vault, run_cli, gap):
    """The padding after ``size`` is outside the checksum: only the zero check sees it (a
    gap between components is inside both)."""
    m = vault.manifest
    gaps = m.record.padding()
    start, end = gaps[0] if gap == "between components" else gaps[-1]
    assert (end == m.record.stride) == (gap == "after size")
    at = (start + end) // 2
    _flip(vault.experts_path, m.record_offset(1, 3) + at)
    problems = ["padding"] if gap == "after size" else ["checksum", "padding"]
    assert [(b.layer, b.expert, b.padding_at, b.problems) for b in verify(vault)] == [
        (1, 3, at, problems)
    ]
    code, out, _ = run_cli("inspect", vault.path, "--verify", "--quiet")
    assert code == 1
    assert f"BAD record: layer 1, expert 3 (record {m.record_index(1, 3)}): " in out
    assert f"nonzero padding at byte {at} of the record" in out
    assert "convert the model again" in out
    code, out, _ = run_cli("inspect", vault.path, "--verify", "--json")
    assert code == 1 and json.loads(out)["verify"]["bad"][0]["problems"] == problems


def test_verify_reports_a_flipped_backbone_byte(vault, run_cli):
    _flip(vault.backbone_path, vault.backbone_path.stat().st_size // 2)
    code, out, _ = run_cli("inspect", vault.path, "--verify", "--quiet")
    assert code == 1
    assert "BAD file: backbone.safetensors" in out and "convert the model again" in out
    assert "all 16 records match" in out  # the records themselves are fine
    code, out, _ = run_cli("inspect", vault.path, "--verify", "--json")
    files = {f["file"]: f["status"] for f in json.loads(out)["verify"]["files"]}
    assert code == 1 and files == {
        "backbone.safetensors": "bad",
        "config.json": "ok",
        "generation_config.json": "ok",  # the files copied from the source, checksummed
    }


def test_verify_reports_a_changed_tokenizer_file(vault, run_cli, tmp_path):
    """The files a vault copies from its source (tokenizer, templates) are checksummed at
    convert: --verify names one changed afterwards, and an engine refuses to load it."""
    copied = vault.manifest.source["copied"]
    assert copied and set(vault.manifest.source["checksums"]) == set(copied)
    victim = vault.path / copied[0]
    original = victim.read_bytes()
    victim.write_bytes(original + b" ")
    try:
        code, out, _ = run_cli("inspect", vault.path, "--verify", "--quiet")
        assert code == 1 and f"{victim} does not match its checksum" in out
        code, _, err = run_cli("generate", vault.path, "--prompt-ids", "1,2", "--max-tokens", "1")
        assert code == 1 and f"{victim} does not match its checksum" in err
        assert "put it back from the source" in err and "Traceback" not in err
    finally:
        victim.write_bytes(original)


@pytest.mark.parametrize("delta", [256, -256, 2**63])
def test_a_bad_offset_cannot_pass_verify(vault, run_cli, delta):
    """A shifted component offset made the engine read the wrong bytes while --verify
    said every record matched (the checksum covers the bytes, not what they mean)."""
    manifest = json.loads((vault.path / "manifest.json").read_text())
    manifest["record"]["components"][2]["offset"] += delta
    manifest = sign_manifest({k: v for k, v in manifest.items() if k != SIGNATURE})
    (vault.path / "manifest.json").write_text(json.dumps(manifest))
    code, out, err = run_cli("inspect", vault.path, "--verify", "--quiet")
    assert code == 1 and not out
    assert "record.components[2].offset" in err and "convert the model again" in err
