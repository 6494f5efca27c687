"""I/O side of the engine: the rings (unified and staged) and the read backend (one
RecordReader: a vault file's records, or a download's shards)."""

from smoe.io.direct import DirectReader, VaultReadError
from smoe.io.direct_file import BufferedIOWarning, open_direct
from smoe.io.reader import RecordReader
from smoe.io.ring import ExpertRing, mx_dtype, needs_conversion
from smoe.io.staged import StagedRing
from smoe.io.unified import UnifiedRing
from smoe.util.sizes import slots_for_budget

__all__ = [
    "BufferedIOWarning",
    "DirectReader",
    "ExpertRing",
    "RecordReader",
    "StagedRing",
    "UnifiedRing",
    "VaultReadError",
    "mx_dtype",
    "needs_conversion",
    "open_direct",
    "slots_for_budget",
]
