"""smoe convert: every architecture, bit-exact records, alignment, atomicity, MLX sources."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from smoe.errors import SmoeError
from smoe.vault.convert import ConvertOptions, convert
from smoe.vault.export import export_mlx, read_layer
from smoe.vault.format import Vault
from smoe.vault.layout import COMPONENT_ALIGN, RECORD_ALIGN
from tests.conftest import HF_ARCHS, edit_json

ARCHS = sorted(HF_ARCHS)

# What mlx-lm 0.32.2's own loader needs to read transformers-5 configs of these archs:
# the key spellings smoe's normaliser fills in (tested separately in test_topology).
_MLX_LM_FIXES = {
    "qwen3_moe": lambda c: {"num_experts": c["num_local_experts"], "head_dim": 16},
    "deepseek_v2": lambda c: {"rope_scaling": {"type": "yarn", "factor": 1.0}},
}


def mlx_lm_reference(src: Path, arch: str):
    """mlx-lm's own model for a transformers checkpoint, experts quantized by mlx-lm."""
    from mlx_lm.utils import load_model

    config = json.loads((src / "config.json").read_text())
    fixes = {"rope_theta": config["rope_parameters"]["rope_theta"]}
    fixes.update(_MLX_LM_FIXES.get(arch, lambda c: {})(config))
    model, _ = load_model(src, model_config=fixes)
    return model


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "gpt_oss"])
def test_records_equal_mlx_lm_quantization(arch, hf_dir, tmp_path):
    """Each record holds exactly mx.quantize of mlx-lm's stacked expert, and the whole vault
    loads back in mlx-lm with parameters and logits equal to mlx-lm's own 4-bit model."""
    from mlx_lm.models.switch_layers import SwitchLinear
    from mlx_lm.utils import load_model

    src = hf_dir(arch)
    vault = convert(src, tmp_path / "v", ConvertOptions())
    ref = mlx_lm_reference(src, arch)
    ref_params = dict(tree_flatten(ref.parameters()))
    m = vault.manifest
    assert m.topology["model_type"] == arch
    assert m.quantization["experts"] == {"mode": "affine", "bits": 4, "group_size": 64}
    for spec in m.layers:
        layer = read_layer(vault, spec.layer)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            w = ref_params[f"{spec.module}.{proj}.weight"]
            q, s, b = mx.quantize(w, 64, 4)
            for e in range(m.num_experts):
                assert mx.array_equal(layer[f"{proj}.weight"][e], q[e])
                assert mx.array_equal(layer[f"{proj}.scales"][e], s[e])
                assert mx.array_equal(layer[f"{proj}.biases"][e], b[e])

    nn.quantize(ref, 64, 4, class_predicate=lambda p, mod: isinstance(mod, SwitchLinear))
    exported, _ = load_model(export_mlx(vault, tmp_path / "mlx"))
    a, b = dict(tree_flatten(exported.parameters())), dict(tree_flatten(ref.parameters()))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and mx.array_equal(a[k], b[k]), k
    x = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    assert mx.array_equal(exported(x), ref(x))


@pytest.mark.parametrize("arch", ARCHS)
def test_float_vault_matches_transformers(arch, hf_dir, tmp_path):
    """A --bits 16 vault, loaded by mlx-lm, computes what transformers computes on the
    original checkpoint (float32 on both sides; the weights are the same bf16 values)."""
    import torch
    import transformers

    src = hf_dir(arch)
    vault = convert(src, tmp_path / "v", ConvertOptions(bits=16))
    assert vault.manifest.quantization["experts"] is None
    from mlx_lm.utils import load_model

    ours, _ = load_model(export_mlx(vault, tmp_path / "mlx"))
    ours.set_dtype(mx.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    got = np.array(ours(mx.array(ids)))
    # Same weights, both float32: only summation order differs (~1e-7 relative per op).
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)


def test_both_config_key_styles_convert_identically(hf_dir, copy_dir, tmp_path):
    """Old-style keys (num_experts, rope_theta, head_dim) and transformers-5 style
    (num_local_experts, rope_parameters) give the same vault."""
    new_style = convert(hf_dir("qwen3_moe"), tmp_path / "new")
    old = copy_dir(hf_dir("qwen3_moe"), "old_ck")
    cfg = json.loads((old / "config.json").read_text())
    edit_json(
        old / "config.json",
        num_local_experts=None,
        rope_parameters=None,
        num_experts=cfg["num_local_experts"],
        rope_theta=cfg["rope_parameters"]["rope_theta"],
        head_dim=16,
    )
    old_style = convert(old, tmp_path / "old")
    assert (tmp_path / "new" / "experts.bin").read_bytes() == (
        tmp_path / "old" / "experts.bin"
    ).read_bytes()
    assert new_style.manifest.topology == old_style.manifest.topology
    assert new_style.manifest.checksums == old_style.manifest.checksums


def test_layout_is_aligned(hf_dir, tmp_path):
    vault = convert(hf_dir("qwen2_moe"), tmp_path / "v", ConvertOptions(bits=8, group_size=32))
    m = vault.manifest
    assert m.record.stride % RECORD_ALIGN == 0
    assert all(c.offset % COMPONENT_ALIGN == 0 for c in m.record.components)
    assert all(
        m.record_offset(s.layer, e) % RECORD_ALIGN == 0
        for s in m.layers
        for e in range(m.num_experts)
    )
    assert vault.experts_path.stat().st_size == m.num_records * m.record.stride
    ends = [c.offset + c.nbytes for c in m.record.components]
    assert max(ends) == m.record.size <= m.record.stride
    assert m.topology["shared_experts"] == 1


@pytest.mark.parametrize(("bits", "group"), [(2, 32), (3, 64), (6, 32), (8, 64)])
def test_bit_widths(bits, group, hf_dir, tmp_path):
    vault = convert(hf_dir("mixtral"), tmp_path / "v", ConvertOptions(bits=bits, group_size=group))
    spec = vault.manifest.layers[1]

    ref = mlx_lm_reference(hf_dir("mixtral"), "mixtral")
    w = dict(tree_flatten(ref.parameters()))[f"{spec.module}.down_proj.weight"]
    q, s, b = mx.quantize(w, group, bits)
    layer = read_layer(vault, spec.layer)
    assert mx.array_equal(layer["down_proj.weight"], q)
    assert mx.array_equal(layer["down_proj.scales"], s)
    assert mx.array_equal(layer["down_proj.biases"], b)


def test_float32_dtype_and_backbone_quantization(hf_dir, tmp_path):
    """--dtype float32 (the CPU's compute dtype) and --backbone-bits 8: routers stay float,
    and mlx-lm loads the result."""
    from mlx_lm.utils import load_model

    vault = convert(
        hf_dir("qwen3_moe"), tmp_path / "v", ConvertOptions(dtype="float32", backbone_bits=8)
    )
    assert vault.manifest.record.component("gate_proj.scales").dtype == "float32"
    header = mx.load(str(vault.backbone_path))
    assert "model.layers.0.self_attn.q_proj.scales" in header
    assert "model.layers.0.mlp.gate.scales" not in header  # the router stays exact
    assert header["model.layers.0.mlp.gate.weight"].dtype == mx.float32
    model, _ = load_model(export_mlx(vault, tmp_path / "mlx"))
    out = model(mx.array([[1, 2, 3]]))
    assert out.shape == (1, 3, 256) and not mx.any(mx.isnan(out)).item()


def test_mlx_quantized_source_is_copied_byte_for_byte(hf_dir, tmp_path):
    """An mlx-community style checkpoint (made by mlx-lm's own convert) is never
    re-quantized: each record is a slice of the source's stacked tensors."""
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    # What mlx_lm.convert does (these test checkpoints carry no tokenizer to copy).
    mlx_src = tmp_path / "mlx_src"
    model, config = load_model(hf_dir("mixtral"), lazy=True)
    model, config = quantize_model(model, config, group_size=64, bits=4)
    save_model(mlx_src, model)
    save_config(config, mlx_src / "config.json")
    vault = convert(mlx_src, tmp_path / "v")
    m = vault.manifest
    assert m.source["kind"] == "mlx"
    assert m.quantization["experts"]["copied_from_source"] is True
    source = {}
    for f in mlx_src.glob("model*.safetensors"):
        source.update(mx.load(str(f)))
    for spec in m.layers:
        layer = read_layer(vault, spec.layer)
        for name, got in layer.items():
            want = source[f"{spec.module}.{name}"]
            assert got.dtype == want.dtype and mx.array_equal(got, want), name
    backbone = mx.load(str(vault.backbone_path))
    for name, a in backbone.items():
        assert a.dtype == source[name].dtype and mx.array_equal(a, source[name]), name
    with pytest.raises(SmoeError, match="copied byte for byte"):
        convert(mlx_src, tmp_path / "v2", ConvertOptions(bits=8))


def test_existing_vault_needs_force(hf_dir, tmp_path):
    convert(hf_dir("olmoe"), tmp_path / "v")
    with pytest.raises(SmoeError, match="--force"):
        convert(hf_dir("olmoe"), tmp_path / "v")
    before = Vault.open(tmp_path / "v").manifest.created
    vault = convert(hf_dir("olmoe"), tmp_path / "v", ConvertOptions(force=True, bits=8))
    assert vault.manifest.quantization["experts"]["bits"] == 8 and before
    assert [p.name for p in tmp_path.iterdir()] == ["v"]  # no temp or old dirs left


def test_force_never_replaces_a_non_vault(hf_dir, tmp_path):
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(SmoeError, match="not a vault"):
        convert(hf_dir("olmoe"), precious, ConvertOptions(force=True))
    assert (precious / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_interrupted_conversion_leaves_no_vault(exc, hf_dir, tmp_path, monkeypatch):
    import smoe.vault.convert as conv

    calls = []
    real = conv._write_layer_records

    def fail_on_second_layer(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise exc()
        return real(*args, **kwargs)

    monkeypatch.setattr(conv, "_write_layer_records", fail_on_second_layer)
    with pytest.raises(exc):
        convert(hf_dir("qwen3_moe"), tmp_path / "v")
    assert list(tmp_path.iterdir()) == []


def test_interrupted_replacement_keeps_the_old_vault(hf_dir, tmp_path, monkeypatch):
    import smoe.vault.convert as conv

    convert(hf_dir("olmoe"), tmp_path / "v")
    old = (tmp_path / "v" / "manifest.json").read_text()

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(conv, "write_safetensors", boom)
    with pytest.raises(KeyboardInterrupt):
        convert(hf_dir("olmoe"), tmp_path / "v", ConvertOptions(force=True, bits=8))
    assert (tmp_path / "v" / "manifest.json").read_text() == old
    Vault.open(tmp_path / "v")
    assert [p.name for p in tmp_path.iterdir()] == ["v"]


def test_a_directory_without_manifest_is_not_a_vault(hf_dir, tmp_path):
    """What a killed (SIGKILL) conversion can leave: the temp dir has no manifest."""
    from smoe.errors import VaultError

    convert(hf_dir("olmoe"), tmp_path / "v")
    (tmp_path / "v" / "manifest.json").unlink()
    with pytest.raises(VaultError, match=r"not a vault \(manifest.json is missing"):
        Vault.open(tmp_path / "v")


def test_a_download_given_where_a_vault_is_needed_names_convert(hf_dir, run_cli):
    """`smoe shard` and the like take vaults only: a checkpoint folder is named as such."""
    src = hf_dir("olmoe")
    code, _, err = run_cli("shard", src, src.parent / "shard", "--ranks", "2", "--rank", "0")
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert f"{src} is a checkpoint folder, not a vault" in err
    assert f"run 'smoe convert {src} VAULT' first" in err


def test_disk_full_before_and_during(hf_dir, tmp_path, monkeypatch):
    import errno

    import smoe.vault.convert as conv

    monkeypatch.setattr(conv, "free_bytes", lambda p: 1000)
    with pytest.raises(SmoeError, match="not enough free space"):
        convert(hf_dir("olmoe"), tmp_path / "v")
    monkeypatch.undo()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(conv, "_write_layer_records", full)
    with pytest.raises(SmoeError, match="filled up"):
        convert(hf_dir("olmoe"), tmp_path / "v")
    assert list(tmp_path.iterdir()) == []


# MLX's peak is process-wide: arrays other tests left alive in this worker count in it, so
# the conversion is measured in a process of its own.
CONVERT_PEAK = (
    "import sys, mlx.core as mx\n"
    "from smoe.vault.convert import ConvertOptions, convert\n"
    "mx.reset_peak_memory()\n"
    "convert(sys.argv[1], sys.argv[2], ConvertOptions(bits=16))\n"
    "print(mx.get_peak_memory())\n"
)


def test_peak_memory_is_about_one_layer(tmp_path):
    """The converter holds one layer's experts at a time, not the model's."""
    src = tmp_path / "big"
    from tests.conftest import make_hf_checkpoint

    make_hf_checkpoint(
        src,
        "qwen3_moe",
        num_hidden_layers=6,
        num_experts=32,
        hidden_size=128,
        moe_intermediate_size=256,
    )
    vault_bytes_per_layer = 32 * 3 * 128 * 256 * 2  # bf16 source experts of one layer
    done = subprocess.run(
        [sys.executable, "-c", CONVERT_PEAK, str(src), str(tmp_path / "v")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    peak = int(done.stdout.split()[-1])
    assert peak < 1.5 * vault_bytes_per_layer, (peak, vault_bytes_per_layer)
    assert (tmp_path / "v" / "manifest.json").exists()  # the run converted the whole model


# ------------------------------------------------------------------ crash safety (issue 13)


def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # reaped: its PID runs nothing now
    return p.pid


def test_force_keeps_a_vault_at_the_target_at_every_step(hf_dir, tmp_path, monkeypatch):
    """After every rename of a --force replacement the target is a whole vault: a kill at
    any of them leaves one (two renames left none in between)."""
    import os

    import smoe.util.files as fsutil

    dst = tmp_path / "v"
    convert(hf_dir("olmoe"), dst)
    seen: list[tuple[str, bool]] = []

    def watch(name, fn):
        def wrapped(*args, **kwargs):
            fn(*args, **kwargs)
            seen.append((name, (dst / "manifest.json").is_file()))

        return wrapped

    monkeypatch.setattr(os, "rename", watch("rename", os.rename))
    monkeypatch.setattr(os, "replace", watch("replace", os.replace))
    if hasattr(fsutil, "exchange"):
        monkeypatch.setattr(fsutil, "exchange", watch("exchange", fsutil.exchange))
    convert(hf_dir("olmoe"), dst, ConvertOptions(force=True, bits=8))
    assert seen and all(ok for _, ok in seen), seen
    assert Vault.open(dst).manifest.quantization["experts"]["bits"] == 8


@pytest.mark.parametrize("new_complete", [True, False])
def test_a_swap_killed_between_its_renames_is_repaired(new_complete, hf_dir, tmp_path):
    """What a kill between the two renames of the fallback swap leaves: no target, the old
    vault aside, the new one beside it. The next convert finishes (or undoes) the swap and
    refuses to overwrite without --force, instead of converting as if there were none."""
    import shutil

    old = convert(hf_dir("olmoe"), tmp_path / "old")
    new = convert(hf_dir("olmoe"), tmp_path / "new", ConvertOptions(bits=8))
    pid = _dead_pid()
    old.path.rename(tmp_path / f".v.old-{pid}")
    new.path.rename(tmp_path / f".v.converting-{pid}")
    if not new_complete:
        (tmp_path / f".v.converting-{pid}" / "manifest.json").unlink()
    with pytest.raises(SmoeError, match="pass --force"):
        convert(hf_dir("olmoe"), tmp_path / "v")
    assert [p.name for p in tmp_path.iterdir()] == ["v"]
    bits = Vault.open(tmp_path / "v").manifest.quantization["experts"]["bits"]
    assert bits == (8 if new_complete else 4)
    shutil.rmtree(tmp_path / "v")


def test_dead_conversions_leftovers_are_removed_live_ones_kept(hf_dir, tmp_path):
    import os

    dead, live = _dead_pid(), os.getppid()
    (tmp_path / f".v.converting-{dead}").mkdir()
    (tmp_path / f".v.converting-{dead}" / "experts.bin").write_bytes(b"\0" * 65536)
    (tmp_path / f".v.converting-{live}").mkdir()  # another conversion still running
    (tmp_path / f".w.converting-{dead}").mkdir()  # another target's: not this run's business
    (tmp_path / ".v.notes").write_text("not ours")
    convert(hf_dir("olmoe"), tmp_path / "v")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".v.notes", f".v.converting-{live}", f".w.converting-{dead}", "v"]
    )
    # leftovers beside a vault: a killed build, and the old tree of a swap killed after it
    (tmp_path / f".v.converting-{dead}").mkdir()
    (tmp_path / f".v.old-{dead}").mkdir()
    with pytest.raises(SmoeError, match="pass --force"):
        convert(hf_dir("olmoe"), tmp_path / "v")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".v.notes", f".v.converting-{live}", f".w.converting-{dead}", "v"]
    )


def test_free_space_estimate_is_the_vault_size(tmp_path, monkeypatch):
    """The space asked for before converting is what the vault takes (records at their
    stride, the backbone as written: cast, quantized; side files) plus a small margin, so
    a disk with room for the vault is not refused. It used to count the source experts of
    every layer but the first as backbone: 2.4x to 4x too much on real models."""
    import smoe.vault.convert as conv
    from tests.conftest import make_hf_checkpoint

    src = make_hf_checkpoint(tmp_path / "src", "qwen3_moe", num_hidden_layers=4)
    estimates: list[int] = []
    real = conv._estimate_bytes

    def spy(plan, layout):
        estimates.append(real(plan, layout))
        return estimates[-1]

    monkeypatch.setattr(conv, "_estimate_bytes", spy)
    encodings = [
        ConvertOptions(),
        ConvertOptions(bits=16),
        ConvertOptions(bits=8, group_size=32, dtype="float32", backbone_bits=8),
    ]
    sizes = []
    for i, opts in enumerate(encodings):
        vault = convert(src, tmp_path / f"v{i}", opts)
        sizes.append(sum(p.stat().st_size for p in vault.path.rglob("*") if p.is_file()))
        assert sizes[-1] <= estimates[-1] <= 1.1 * sizes[-1], (opts, estimates[-1], sizes[-1])
    # a disk with 5% more free space than the vault needs converts it
    monkeypatch.setattr(conv, "free_bytes", lambda p: int(1.05 * sizes[0]))
    convert(src, tmp_path / "tight", encodings[0])
