"""S-MoE: run Mixture-of-Experts models larger than memory, exactly.

The routed experts live in an on-disk vault and stream into a preallocated ring;
everything else stays resident. See README.md and docs/.
"""

from smoe.errors import CheckpointError, SmoeError, UnsupportedModelError, VaultError

__version__ = "0.1.0"
__all__ = ["CheckpointError", "SmoeError", "UnsupportedModelError", "VaultError", "__version__"]
