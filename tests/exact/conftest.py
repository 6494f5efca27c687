"""Fixtures of the exactness tests."""

from __future__ import annotations

import pytest

from smoe.vault.convert import ConvertOptions, convert
from smoe.vault.format import Vault


@pytest.fixture(scope="module")
def quantized(hf_dir, tmp_path_factory):
    """Factory: (4-bit float32-scale vault, mlx-lm reference) per arch, converted once."""
    from tests.exact.test_engine_exact import reference_model

    cache: dict[str, tuple[Vault, object]] = {}

    def get(arch: str) -> tuple[Vault, object]:
        if arch not in cache:
            root = tmp_path_factory.mktemp(f"exact-{arch}")
            vault = convert(hf_dir(arch), root / "v", ConvertOptions(dtype="float32"))
            cache[arch] = (vault, reference_model(vault, root / "mlx"))
        return cache[arch]

    return get
