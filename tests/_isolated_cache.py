"""The test suite keeps S-MoE's cache in a folder of its own (issue 49): run against the
user's ``~/.cache/smoe``, tests wrote chat history lines into it and disk-probe figures
measured on pytest's temporary files, which `smoe plan` later showed as "(cached)".

Registered from tests/conftest.py (``pytest_plugins``). SMOE_CACHE is set in os.environ
itself, so every command a test spawns inherits it. XDG_CACHE_HOME is left alone: with
SMOE_CACHE set S-MoE never reads it (smoe.util.cache), and other libraries keep their
own caches under it (Hugging Face's, read offline by some tests).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def isolated_smoe_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """SMOE_CACHE: a folder under pytest's temporary base, for the whole session (a test
    that sets its own still does, for itself)."""
    folder = tmp_path_factory.mktemp("smoe-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SMOE_CACHE", str(folder))
        yield
