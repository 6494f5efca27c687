"""The vault's tokenizer, loaded with mlx-lm after its files are checked.

The tokenizer files are copied into the vault from the checkpoint but are not part of
its signed records, so they are untrusted input: a truncated or binary file, or one
missing, must be a one-line ``VaultError`` naming the fix, not a traceback from
``json``, ``tokenizers`` or transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from smoe.errors import VaultError

# The JSON files mlx-lm's loader (through transformers) reads, where present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

_FIX = "copy the tokenizer files again from the original checkpoint, or convert it again"


def has_tokenizer(path: Path) -> bool:
    """Whether the vault at ``path`` carries a tokenizer (else: token ids only)."""
    return (path / "tokenizer_config.json").exists() or (path / "tokenizer.json").exists()


def check_tokenizer_files(path: Path) -> None:
    """Each of ``TOKENIZER_FILES`` present in ``path`` is UTF-8 JSON holding an object.
    Raises VaultError naming the file and the fix."""
    for name in TOKENIZER_FILES:
        file = path / name
        if not file.exists():
            continue
        try:
            data = json.loads(file.read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise VaultError(f"{file} is unreadable ({_first_line(e)}): {_FIX}") from None
        if not isinstance(data, dict):
            raise VaultError(f"{file} does not hold a JSON object: {_FIX}")


def load_tokenizer(path: Path, eos_token_ids: list[int] | None) -> Any:
    """mlx-lm's tokenizer wrapper for the vault at ``path``, or None where it has none.
    Raises VaultError where its files are damaged or incomplete (say, tokenizer.json
    removed where no slow tokenizer can replace it)."""
    from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

    if not has_tokenizer(path):
        return None
    try:
        return mlx_lm_load_tokenizer(path, eos_token_ids=eos_token_ids)  # type: ignore[no-untyped-call]
    except Exception as e:  # transformers' loaders raise many kinds; none is ours to show
        # Checked only now: a large tokenizer.json is not parsed twice on every open.
        check_tokenizer_files(path)
        raise VaultError(
            f"the tokenizer in {path} cannot be loaded ({type(e).__name__}: "
            f"{_first_line(e)}): {_FIX}"
        ) from None


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else type(e).__name__
