"""A model named as on the Hugging Face Hub (``org/name``), found in the local Hugging Face
cache, as mlx-lm, llama.cpp and ollama take a Hub name.

Offline first: the name resolves only to a snapshot already downloaded (the hub library's
cache, ``HF_HUB_CACHE`` or ``HF_HOME``), unless ``download`` asks for it, when
``huggingface_hub`` fetches it. A path that exists is always the path.
"""

from __future__ import annotations

import re
from pathlib import Path

from smoe.errors import SmoeError

# org/name: what the Hub accepts (letters, digits, '-', '_', '.'), one slash, no '..'
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")


def looks_like_repo_id(text: str) -> bool:
    """Whether ``text`` reads as a Hub repository id rather than a local path."""
    return bool(_REPO_ID.match(text)) and ".." not in text and not text.endswith(".")


def resolve_model(arg: Path | str, download: bool = False) -> Path:
    """``arg`` if it exists; else, for a Hub id, its snapshot in the local cache
    (downloaded first with ``download``). Raises SmoeError naming the fix when it is not
    there; other paths are returned as given (the caller reports them missing)."""
    path = Path(arg)
    text = str(arg)
    if path.exists() or not looks_like_repo_id(text):
        return path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(text, local_files_only=not download))
    except LocalEntryNotFoundError:
        raise SmoeError(
            f"{text} is not a folder here, nor downloaded in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); download it with 'hf download {text}', or add "
            "--download"
        ) from None
    except HFValidationError as e:
        raise SmoeError(f"{text} is not a folder here, nor a Hub name: {e}") from None
    except OSError as e:  # a download that failed: the network, the disk, a 404
        raise SmoeError(f"could not download {text} from the Hugging Face Hub: {e}") from None
