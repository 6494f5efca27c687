"""The built-in demo: made on first use (without PyTorch), reused afterwards."""

from __future__ import annotations

import json
import sys
import time

import pytest

from smoe.chat.demo import DEMO_NAME, demo_vault
from smoe.synth import layout
from smoe.synth.presets import resolve
from smoe.vault.format import Vault


def test_frozen_demo_layout_is_what_transformers_writes():
    p, n = resolve("qwen3_moe", "demo", None)
    frozen_config, frozen_specs = layout.build("qwen3_moe", "demo", p, n, "bfloat16")
    live_config, live_specs = layout.build_live("qwen3_moe", p, n, "bfloat16")
    assert isinstance(frozen_config, layout.FrozenConfig)
    frozen = json.loads(frozen_config.to_json_string())
    live = json.loads(live_config.to_json_string(use_diff=True))
    # The layout, not the label of the transformers release that wrote it.
    assert frozen.pop("transformers_version") and live.pop("transformers_version")
    assert frozen == live
    assert frozen_specs == live_specs


def test_demo_is_made_once_without_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("SMOE_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now fails
    said = []
    path = demo_vault(progress=said.append)
    assert path == tmp_path / DEMO_NAME and any("first run" in s for s in said)
    vault = Vault.open(path)
    assert vault.manifest.topology["model_type"] == "qwen3_moe"
    assert vault.manifest.record.component("gate_proj.scales").dtype == "float32"
    assert sorted(p.name for p in tmp_path.iterdir()) == [DEMO_NAME]  # no leftovers
    start = time.perf_counter()
    said.clear()
    assert demo_vault(progress=said.append) == path
    assert said == [] and time.perf_counter() - start < 1.0  # reused, not rebuilt


def test_a_damaged_demo_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("SMOE_CACHE", str(tmp_path))
    path = demo_vault()
    (path / "manifest.json").unlink()
    assert demo_vault() == path
    Vault.open(path)


@pytest.mark.asyncio
async def test_demo_chats(tmp_path, monkeypatch):
    from smoe.engine import Engine

    monkeypatch.setenv("SMOE_CACHE", str(tmp_path))
    async with Engine.open(demo_vault(), slots=61) as engine:  # 2 MB of experts
        conv = engine.conversation(system="You are a demo.")
        events = [ev async for ev in conv.send("Hello!", max_tokens=8)]
        assert events[-1].finish_reason in ("stop", "length")
        assert conv.messages[-1]["role"] == "assistant"


def test_a_demo_made_before_backbone_checksums_is_rebuilt(tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("SMOE_CACHE", str(tmp_path))
    path = demo_vault()
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["backbone"]["checksum"]  # as an older S-MoE wrote it
    (path / "manifest.json").write_text(json.dumps(manifest))
    said: list[str] = []
    assert demo_vault(progress=said.append) == path
    assert said and "checksum" in json.loads((path / "manifest.json").read_text())["backbone"]
