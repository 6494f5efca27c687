"""The reader for a model, and the host memory it keeps: a vault reads one file, a
download (``Source``) its shards. Chosen by the model's type (``functools.singledispatch``),
so no caller asks which kind it holds."""

from __future__ import annotations

import functools

from smoe.io.direct import DirectReader
from smoe.io.reader import RecordReader
from smoe.io.ring import ExpertRing
from smoe.io.shard_reader import ShardReader, bounce_bytes
from smoe.vault.format import Vault
from smoe.vault.source import Source


@functools.singledispatch
def open_reader(
    model: Vault, ring: ExpertRing, *, workers: int, direct: bool, parts: int | None
) -> RecordReader:
    """A started reader of ``model``'s records into ``ring`` (close it when done).
    Raises ValueError for bad arguments, VaultError for files that cannot be opened."""
    return DirectReader(model, ring, workers=workers, direct=direct, parts=parts)


@open_reader.register
def _(
    model: Source, ring: ExpertRing, *, workers: int, direct: bool, parts: int | None
) -> RecordReader:
    return ShardReader(model, ring, workers=workers, direct=direct, parts=parts)


@functools.singledispatch
def reader_host_bytes(model: Vault, workers: int) -> int:
    """Host memory a reader of ``workers`` threads keeps beside the ring: none for a
    vault (reads land in the ring's own memory)."""
    return 0


@reader_host_bytes.register
def _(model: Source, workers: int) -> int:
    return bounce_bytes(model, workers)  # its bounce buffers
