"""The GPU tests' shared fixture (their helpers are in gpu_common)."""

import pytest

from tests.gpu.gpu_common import load_models


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Factory: (vault, mlx-lm's model of its export as loaded) per (arch, bits)."""
    return load_models(tmp_path_factory.mktemp)
