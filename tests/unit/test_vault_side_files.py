"""Files a vault carries but does not sign are untrusted input (issue 30): truncated,
binary or missing tokenizer files end the command with one line naming the file and the
fix, and popularity counts that cannot be kept warn in one line, never a traceback."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from smoe.engine.tokenizer import check_tokenizer_files, load_tokenizer
from smoe.errors import VaultError
from tests.conftest import tiny_vault


@pytest.fixture(scope="module")
def vault_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(tiny_vault(tmp_path_factory.mktemp("tok"), seed=5).path)


def damaged(vault_dir: Path, tmp_path: Path, name: str, data: bytes | None) -> Path:
    """A copy of the vault with ``name`` replaced by ``data`` (None: removed)."""
    copy = tmp_path / "v"
    shutil.copytree(vault_dir, copy)
    if data is None:
        (copy / name).unlink()
    else:
        (copy / name).write_bytes(data)
    return copy


DAMAGE = [
    ("tokenizer.json", "truncated", "tokenizer.json is unreadable"),
    ("tokenizer.json", "binary", "tokenizer.json is unreadable"),
    ("tokenizer.json", "removed", "cannot be loaded"),
    ("tokenizer_config.json", "truncated", "tokenizer_config.json is unreadable"),
    ("tokenizer_config.json", "binary", "tokenizer_config.json is unreadable"),
    ("special_tokens_map.json", "truncated", "special_tokens_map.json is unreadable"),
    ("special_tokens_map.json", "binary", "special_tokens_map.json is unreadable"),
]


def _bytes(vault_dir: Path, name: str, how: str) -> bytes | None:
    if how == "removed":
        return None
    if how == "truncated":
        return (vault_dir / name).read_bytes()[:20]
    return bytes(range(128, 256)) * 8  # not UTF-8


@pytest.mark.parametrize(("name", "how", "says"), DAMAGE)
def test_damaged_tokenizer_file_is_one_line(
    vault_dir: Path, tmp_path: Path, name: str, how: str, says: str
) -> None:
    copy = damaged(vault_dir, tmp_path, name, _bytes(vault_dir, name, how))
    with pytest.raises(VaultError, match=says) as info:
        load_tokenizer(copy, None)
    assert "\n" not in str(info.value) and "original checkpoint" in str(info.value)


def test_generate_on_a_damaged_tokenizer_prints_one_line(
    vault_dir: Path, tmp_path: Path, run_cli
) -> None:
    copy = damaged(vault_dir, tmp_path, "tokenizer.json", b'{"version": "1.0", "trunc')
    code, out, err = run_cli("generate", copy, "--prompt", "t5 t6", "--max-tokens", "2")
    assert code != 0
    # The checksum recorded at convert refuses it before the tokenizer is parsed (a vault
    # made before checksums gets the parse's own line: test_damaged_tokenizer_file_...).
    assert "Traceback" not in err and "tokenizer.json does not match its checksum" in err
    assert len(err.strip().splitlines()) == 1


def test_a_sound_tokenizer_loads_and_checks(vault_dir: Path) -> None:
    check_tokenizer_files(vault_dir)  # no error
    assert load_tokenizer(vault_dir, None) is not None


def test_json_that_is_not_an_object_is_refused(vault_dir: Path, tmp_path: Path) -> None:
    copy = damaged(vault_dir, tmp_path, "special_tokens_map.json", b"[1, 2]")
    with pytest.raises(VaultError, match="does not hold a JSON object"):
        check_tokenizer_files(copy)


@pytest.mark.parametrize("broken", ["stats is a file", "popularity.npz is a folder"])
def test_unkept_popularity_warns_in_one_line(
    vault_dir: Path, tmp_path: Path, run_cli, broken: str
) -> None:
    """The run works; each warning is one line naming the fix, without the source line
    Python prints with a warning (which read as a traceback)."""
    copy = tmp_path / "v"
    shutil.copytree(vault_dir, copy)
    shutil.rmtree(copy / "stats", ignore_errors=True)
    if broken == "stats is a file":
        (copy / "stats").write_text("")
    else:
        (copy / "stats" / "popularity.npz").mkdir(parents=True)
    code, out, err = run_cli("generate", copy, "--prompt", "t5 t6", "--max-tokens", "2")
    assert code == 0 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    warned = [line for line in lines if line.startswith("smoe generate: warning: ")]
    assert warned and all(not line.startswith(" ") for line in lines)
    if broken == "stats is a file":
        assert any("writable folder" in line for line in warned)
