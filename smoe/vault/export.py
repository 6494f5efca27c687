"""Read records back into stacked expert tensors; export a vault as an mlx-lm model folder.

The export is what mlx-lm itself loads (``mlx_lm.load``): the in-memory reference that
S-MoE's streamed output is compared with. It needs memory for the whole model.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from smoe.errors import SmoeError, VaultError, WriteError
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
from smoe.vault.integrity import hasher
from smoe.vault.tensorfile import write_safetensors


def read_layer(vault: Vault, layer: int, verify: bool = False) -> dict[str, mx.array]:
    """One MoE layer's experts from experts.bin, as {component: [E, ...]} arrays.
    ``verify``: each record checked against its checksum in the manifest (VaultError
    naming the first bad one)."""
    m = vault.manifest
    n, stride = m.num_experts, m.record.stride
    buf = np.empty((n, stride), dtype=np.uint8)
    try:
        with open(vault.experts_path, "rb") as f:
            f.seek(m.layer_position(layer) * n * stride)
            got = f.readinto(memoryview(buf).cast("B"))
    except OSError as e:
        raise VaultError(
            f"{vault.experts_path} is unreadable ({e.strerror}); check the disk, or convert "
            "the model again"
        ) from None
    if got != buf.nbytes:
        raise SmoeError(f"{vault.experts_path} is truncated; run 'smoe inspect --verify'")
    if verify and m.checksums:
        checksum = hasher(m.checksum_algorithm)
        for expert in range(n):
            i = m.record_index(layer, expert)
            if checksum(memoryview(buf[expert, : m.record.size])) != m.checksums[i]:
                raise VaultError(
                    f"expert {expert} of layer {layer} (record {i}) in {vault.experts_path} "
                    "does not match its checksum: nothing was exported; run 'smoe inspect "
                    "--verify', or convert the model again"
                )
    out = {}
    for c in m.record.components:
        raw = mx.array(np.ascontiguousarray(buf[:, c.offset : c.offset + c.nbytes]))
        out[c.name] = raw.view(getattr(mx, c.dtype)).reshape(n, *c.shape)
    return out


def export_mlx(vault: Vault, out: Path | str, force: bool = False) -> Path:
    """Write an mlx-lm model folder (config, tokenizer, one model.safetensors) for ``vault``,
    from bytes checked against the manifest (the backbone hashed, each record's checksum,
    the tokenizer and template files where the vault records theirs),
    every file fsynced before the folder takes its name. VaultError names what is damaged,
    WriteError an OS error writing (a full disk, EIO, a target that cannot be made, with
    its path and errno); nothing is left at ``out`` then (a folder already there stays as
    it was). What killed exports left beside ``out`` is removed first."""
    out = Path(out)
    # What killed exports left beside it (each as large as the model) goes first.
    tidy_target(out, lambda p: (p / "model.safetensors").is_file(), "export")
    if out.exists() and not force:
        raise SmoeError(f"{out} exists; pass --force to replace it")
    try:
        tmp = make_temp_dir(out, "exporting")
    except OSError as e:  # a file where a folder must be, a read-only or virtual file system
        raise WriteError("the mlx-lm export", out, e, temp_path(out, "exporting")) from e
    try:
        vault.verify_backbone(force=True)  # (what mlx-lm will run: hashed now)
        vault.verify_side_files()  # the tokenizer and templates it will read, too
        tensors = dict(mx.load(str(vault.backbone_path)))
        for spec in vault.manifest.layers:
            for name, a in read_layer(vault, spec.layer, verify=True).items():
                tensors[f"{spec.module}.{name}"] = a
        write_safetensors(tmp / "model.safetensors", tensors, {"format": "mlx"})
        write_json_atomic(tmp / "config.json", vault.config())
        # The files the manifest vouches for (copied from the source at convert), no others:
        # plain names, each a regular file inside the vault, the bytes written the ones
        # checked against its checksum (Vault.read_side_file): a crafted manifest cannot
        # bring ~/.ssh/id_rsa into the export.
        for name in vault.side_files():
            data = vault.read_side_file(name)
            with open(tmp / name, "wb") as w:
                w.write(data)
            fsync_path(tmp / name)
        fsync_path(tmp)
        replace_dir(tmp, out)
    except OSError as e:  # a full disk, an I/O error: one line naming the path and errno
        remove_tree(tmp)
        raise WriteError("the mlx-lm export", out, e, tmp) from e
    except BaseException:
        remove_tree(tmp)
        raise
    return out
