"""A Hub name that is not downloaded: the one line names a fix the command takes (only
generate, chat and serve have --download), and with --download and no Hub to reach it
says the download failed, not "add --download"."""

from __future__ import annotations

import pytest

MISSING = "smoe-tests/not-there"


@pytest.fixture(autouse=True)
def empty_hub_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never the network, whatever happens


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("argv", [["inspect", MISSING], ["plan", MISSING, "--no-compute"]])
def test_commands_without_download_name_hf_download_only(run_cli, argv):
    code, out, err = run_cli(*argv)
    line = one_line(err)
    assert code == 1 and out == ""
    assert f"download it with 'hf download {MISSING}' first" in line
    assert "--download" not in line


def test_generate_without_download_offers_it(run_cli):
    code, _, err = run_cli("generate", MISSING, "--prompt-ids", "5")
    line = one_line(err)
    assert code == 1 and f"'hf download {MISSING}', or add --download" in line


def test_a_download_that_cannot_reach_the_hub_says_so(run_cli):
    code, _, err = run_cli("generate", MISSING, "--prompt-ids", "5", "--download")
    line = one_line(err)
    assert code == 1 and f"could not download {MISSING} from the Hugging Face Hub" in line
    assert "add --download" not in line and "check the network" in line
