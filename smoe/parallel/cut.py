"""`smoe shard`: cut one rank's shard out of a vault (smoe/vault/shard.py says what it is).

The expert assignment is the one a group computes when it runs the full vault
(``ExpertAssignment.balanced``, from the vault's popularity counts where it has them), so
a shard serves exactly the experts its rank would compute. The shard is written beside
its target under a temporary name and renamed into place once complete and fsynced
(smoe/util/files.py): a kill leaves the old target or the new one, never a mix.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from smoe.errors import SmoeError, VaultError, WriteError
from smoe.parallel.assignment import ExpertAssignment
from smoe.sched.popularity import Popularity
from smoe.util.files import (
    fsync_path,
    make_temp_dir,
    remove_tree,
    replace_dir,
    temp_path,
    tidy_target,
    write_json_atomic,
)
from smoe.vault.format import Vault
from smoe.vault.names import EXPERTS_FILE, MANIFEST, STATS_DIR
from smoe.vault.shard import MAX_RANKS, Shard

CHUNK = 64 << 20  # bytes copied per read


def cut_shard(
    src: Path | str,
    dst: Path | str,
    ranks: int,
    rank: int,
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> Vault:
    """Write rank ``rank`` of ``ranks``'s shard of the vault ``src`` at ``dst`` and return
    it opened. SmoeError for a bad rank, a shard as source, or an existing ``dst`` without
    ``force``; VaultError for a damaged source; WriteError for an OS error writing (path
    and errno named). What killed runs left beside ``dst`` is removed first."""
    vault = Vault.open(src)
    m = vault.manifest
    if m.shard is not None:
        raise SmoeError(f"{vault.path} is already a shard; cut shards from the full vault")
    if not 1 <= ranks <= MAX_RANKS or not 0 <= rank < ranks:
        raise SmoeError(
            f"give --ranks 1..{MAX_RANKS} and --rank 0..ranks-1 (got {rank} of {ranks})"
        )
    dst = Path(dst)
    # What killed runs left beside it (each as large as the shard) goes first.
    tidy_target(dst, lambda p: (p / MANIFEST).is_file(), "shard")
    if dst.exists() and not force:
        raise SmoeError(f"{dst} exists; pass --force to replace it")
    layers = [spec.layer for spec in m.layers]
    counts = Popularity(vault).counts
    owners = ExpertAssignment.balanced(layers, m.num_experts, ranks, counts).owners
    shard = Shard(
        rank,
        ranks,
        tuple(tuple(int(r) for r in row) for row in owners),
        m.identity(),
        tuple(layers),
    )
    manifest = dataclasses.replace(
        m, shard=shard, checksums=[m.checksums[m.record_index(*k)] for k in shard.keys]
    )
    try:
        tmp = make_temp_dir(dst, "converting")
    except OSError as e:  # a file where a folder must be, a read-only or virtual file system
        raise WriteError("the shard", dst, e, temp_path(dst, "converting")) from e
    try:
        for item in sorted(vault.path.iterdir()):
            if item.name in (EXPERTS_FILE, MANIFEST, STATS_DIR) or item.name.startswith("."):
                continue
            # Regular files of the vault only: not a link out of it, which would copy
            # whatever it points to (~/.ssh/...) into the shard, nor a FIFO.
            if item.is_file() and item.resolve().is_relative_to(vault.path.resolve()):
                shutil.copyfile(item, tmp / item.name)
                fsync_path(tmp / item.name)
        (tmp / STATS_DIR).mkdir()
        _copy_records(vault, [m.record_index(*k) for k in shard.keys], tmp / EXPERTS_FILE, progress)
        write_json_atomic(tmp / MANIFEST, manifest.to_json())  # last: now it is a vault
        fsync_path(tmp)
        replace_dir(tmp, dst)
    except OSError as e:  # a full disk, an I/O error: one line naming the path and errno
        remove_tree(tmp)
        raise WriteError("the shard", dst, e, tmp) from e
    except BaseException:
        remove_tree(tmp)
        raise
    return Vault.open(dst)


def _copy_records(
    vault: Vault,
    records: list[int],
    out: Path,
    progress: Callable[[int, int], None] | None,
) -> None:
    """The ``records`` of ``vault``, whole strides (alignment padding included), in order."""
    stride = vault.manifest.record.stride
    with open(vault.experts_path, "rb") as f, open(out, "wb") as w:
        for done, r in enumerate(records, 1):
            f.seek(r * stride)
            left = stride
            while left:
                data = _read(f, vault, min(left, CHUNK))
                if not data:
                    raise SmoeError(f"{vault.experts_path} ends inside record {r}; convert again")
                w.write(data)
                left -= len(data)
            if progress is not None:
                progress(done, len(records))
        w.flush()
        os.fsync(w.fileno())


def _read(f: BinaryIO, vault: Vault, size: int) -> bytes:
    """Up to ``size`` bytes of the source's experts.bin; its read errors named as such (a
    write error is the shard's: WriteError)."""
    try:
        return f.read(size)
    except OSError as e:
        raise VaultError(
            f"{vault.experts_path} is unreadable ({e.strerror}); check the disk, or convert "
            "the model again"
        ) from None
