"""A Hub name (``org/name``) where a model folder goes: the snapshot in the local Hugging
Face cache, laid out as huggingface_hub lays it out (models--org--name/refs/main naming a
snapshot folder), offline; a name not downloaded is one line naming the fix."""

from __future__ import annotations

import json
import shutil

import pytest

from smoe.synth import synthesize
from smoe.vault.hub import looks_like_repo_id, resolve_model

REPO = "smoe-tests/tiny-moe"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face cache holding REPO's snapshot (a synth checkpoint)."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hub"
    repo = cache / ("models--" + REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    src = synthesize(tmp_path / "src", arch="qwen3_moe", preset="tiny", seed=3)
    shutil.copytree(src, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never the network, whatever happens
    return snapshot


def test_repo_ids_and_paths_are_told_apart():
    assert looks_like_repo_id("mlx-community/Qwen3-30B-A3B-4bit")
    for path in ("./models/x", "/abs/path", "a/b/c", "../x/y", "name", "org/.."):
        assert not looks_like_repo_id(path), path


def test_a_hub_name_runs_from_its_cached_snapshot(hub_cache, run_cli):
    assert resolve_model(REPO) == hub_cache
    outs = []
    for model in (REPO, str(hub_cache)):
        code, out, err = run_cli(
            "generate", model, "--prompt-ids", "5,6,7", "--max-tokens", "3", "--json"
        )
        assert code == 0, err
        outs.append(json.loads(out)["tokens"])
    assert outs[0] == outs[1]
    code, out, err = run_cli("inspect", REPO)
    assert code == 0 and str(hub_cache) in out, err


def test_a_hub_name_not_downloaded_names_the_fix(hub_cache, run_cli):
    code, _, err = run_cli("generate", "smoe-tests/not-there", "--prompt-ids", "5")
    assert code == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "hf download smoe-tests/not-there" in err and "--download" in err
