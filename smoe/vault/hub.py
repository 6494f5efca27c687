"""A model named as on the Hugging Face Hub (``org/name``), found in the local Hugging Face
cache, as mlx-lm, llama.cpp and ollama take a Hub name.

Offline first: the name resolves only to a snapshot already downloaded (the hub library's
cache, ``HF_HUB_CACHE`` or ``HF_HOME``), unless ``download`` asks for it, when
``huggingface_hub`` fetches it. A path that exists is always the path. The cache is
untrusted like any file: its ref must name a commit and its snapshot lie in the
repository's snapshots folder.
"""

from __future__ import annotations

import re
from pathlib import Path

from smoe.errors import SmoeError
from smoe.util.files import NotRegularFile, open_regular
from smoe.vault.checks import show

# org/name: what the Hub accepts (letters, digits, '-', '_', '.'), one slash, no '..'
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
_COMMIT = re.compile(rb"[0-9a-f]{40}(?:[0-9a-f]{24})?")


def looks_like_repo_id(text: str) -> bool:
    """Whether ``text`` reads as a Hub repository id rather than a local path."""
    return bool(_REPO_ID.match(text)) and ".." not in text and not text.endswith(".")


def resolve_model(arg: Path | str, download: bool = False, offers_download: bool = True) -> Path:
    """``arg`` if it exists; else, for a Hub id, its snapshot in the local cache
    (downloaded first with ``download``). Raises SmoeError naming the fix when it is not
    there (``--download`` only where the command has it: ``offers_download``); other
    paths are returned as given (the caller reports them missing)."""
    path = Path(arg)
    text = str(arg)
    if path.exists() or not looks_like_repo_id(text):
        return path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    repo = Path(constants.HF_HUB_CACHE) / ("models--" + text.replace("/", "--"))
    _check_ref(repo, text, commit=not download)  # a download writes a new one
    try:
        snapshot = Path(snapshot_download(text, local_files_only=not download))
    except LocalEntryNotFoundError as e:
        if download:  # asked for, and the Hub could not be reached (or HF_HUB_OFFLINE=1)
            raise SmoeError(
                f"could not download {text} from the Hugging Face Hub: {_one_line(e)}; "
                f"check the network, or download it elsewhere with 'hf download {text}'"
            ) from None
        also = ", or add --download" if offers_download else " first"
        raise SmoeError(
            f"{text} is not a folder here, nor downloaded in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); download it with 'hf download {text}'{also}"
        ) from None
    except HFValidationError as e:
        raise SmoeError(f"{text} is not a folder here, nor a Hub name: {_one_line(e)}") from None
    except OSError as e:  # a download that failed: the network, the disk, a 404
        raise SmoeError(
            f"could not download {text} from the Hugging Face Hub: {_one_line(e)}"
        ) from None
    # The cache is a folder anyone sharing it can write: its snapshot must be one of the
    # repository's, not wherever a crafted ref or a link points.
    try:
        inside = snapshot.resolve(strict=True).parent == (repo / "snapshots").resolve(strict=True)
    except (OSError, RuntimeError):
        inside = False
    if not inside:
        raise SmoeError(
            f"{text}'s snapshot in the Hugging Face cache, {snapshot}, lies outside "
            f"{repo / 'snapshots'}: the cache is damaged or was tampered with; remove {repo} "
            f"and download {text} again"
        )
    return snapshot


def _one_line(e: Exception) -> str:
    """The hub library's message, which spans lines, as one (an error is one line)."""
    return " ".join(str(e).split())


def _check_ref(repo: Path, text: str, commit: bool) -> None:
    """The cache's refs/main is a regular file (huggingface_hub would block forever on a
    FIFO there) and, with ``commit``, names a commit: 40 (SHA-1) or 64 (SHA-256) hex
    digits (the hub library joins what it holds, "../../x" too, to the snapshots folder).
    SmoeError naming the file and the fix otherwise; nothing if there is none (the hub
    library then says the name is not downloaded)."""
    ref = repo / "refs" / "main"
    fix = (
        f"the Hugging Face cache is damaged or was tampered with; remove {repo} and download "
        f"{text} again"
    )
    try:
        with open_regular(ref) as f:
            held = f.read(65)
    except FileNotFoundError:
        return
    except NotRegularFile as e:
        raise SmoeError(f"{ref} is {e.kind}, not a regular file; {fix}") from None
    except OSError as e:
        raise SmoeError(f"{ref} is unreadable ({e.strerror}); {fix}") from None
    if commit and not _COMMIT.fullmatch(held):
        raise SmoeError(f"{ref} holds {show(held.decode(errors='replace'))}, not a commit; {fix}")
