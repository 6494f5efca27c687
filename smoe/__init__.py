"""S-MoE: run Mixture-of-Experts models larger than memory, exactly.

The routed experts live in an on-disk vault and stream into a preallocated ring;
everything else stays resident. See README.md and docs/.
"""

from typing import Any

from smoe.errors import CheckpointError, SmoeError, UnsupportedModelError, VaultError
from smoe.util import fdlimit

# Before anything imports mlx-lm: its import sets the open-file limit, which fails under a
# hard limit below 4096 (smoe/util/fdlimit.py).
fdlimit.install()

__version__ = "0.1.0"
__all__ = [
    "CheckpointError",
    "Engine",
    "SmoeError",
    "UnsupportedModelError",
    "VaultError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # The engine imports MLX; keep `import smoe` light for the CLI and the scheduler.
    if name == "Engine":
        import importlib

        return importlib.import_module("smoe.engine").Engine
    raise AttributeError(name)
