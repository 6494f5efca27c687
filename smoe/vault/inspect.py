"""`smoe inspect`: summarise a vault; with --verify re-check every record (checksum and
zero padding) and the backbone's and config's checksums."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from smoe.errors import VaultError
from smoe.util.sizes import format_bytes
from smoe.vault.format import Vault
from smoe.vault.integrity import hasher
from smoe.vault.names import BACKBONE_FILE, CONFIG_FILE


def summary(vault: Vault) -> dict[str, Any]:
    """The facts `smoe inspect --json` prints."""
    m = vault.manifest
    # A download's manifest is made in memory (smoe.vault.source): its format is the
    # folder's, a Hugging Face or an MLX checkpoint, and no vault format or producer.
    download = bool(vault.streamed())
    return {
        "path": str(vault.path),
        "format": f"{m.source.get('kind', 'hf')}-checkpoint" if download else m.format,
        "version": None if download else m.version,
        "producer": None if download else m.producer,
        "created": m.created,
        "source": m.source,
        "topology": m.topology,
        "quantization": m.quantization,
        "record": {
            "size": m.record.size,
            "stride": m.record.stride,
            "count": m.num_records,
            "components": [c.to_json() for c in m.record.components],
        },
        "experts_bytes": m.experts_bytes,
        "backbone_bytes": m.backbone["bytes"],  # the file's size (checked at open)
        "total_bytes": sum(p.stat().st_size for p in vault.path.rglob("*") if p.is_file()),
        **_streamed(vault),
    }


def _streamed(vault: Vault) -> dict[str, Any]:
    """For a checkpoint folder (a Source): how its experts would be read."""
    how = vault.streamed()
    return {"streamed": how} if how else {}


def render(info: dict[str, Any]) -> str:
    """A human-readable summary."""
    t, q, r = info["topology"], info["quantization"], info["record"]

    def quant(x: dict[str, Any] | None) -> str:
        # What the manifest's validation lets through, and the engine runs, is printed:
        # an entry absent (older vaults) or summarising per-projection packings.
        if not x:
            return "float (unquantized)"
        if x.get("bits") is None and isinstance(x.get("projections"), dict):
            how = "per projection"
        else:
            how = f"{x.get('mode', 'affine')} {x.get('bits', '?')}-bit, group {x.get('group_size', '?')}"
        return how + (" (copied from the MLX source)" if x.get("copied_from_source") else "")

    lines = [
        f"vault      {info['path']}  (format v{info['version']}, {info['producer']})",
        f"model      {t['model_type']}: {t['num_layers']} layers, hidden {t['hidden_size']}, "
        f"vocab {t['vocab_size']}",
        f"experts    {t['num_experts']} per MoE layer, top-{t['experts_per_token']}, "
        f"{t['expert_kind']} hidden {t['expert_hidden_size']}, "
        f"{len(t['moe_layers'])} MoE layers, shared experts {t['shared_experts']}",
        f"quantized  experts: {quant(q.get('experts'))}; backbone: {quant(q.get('backbone'))}",
        # On disk: a ring slot in memory may differ (a staged ring holds the record in the
        # compute dtype), and `smoe plan` and the run commands name that one as the slot.
        f"records    {r['count']} x {format_bytes(r['stride'])} on disk "
        f"({r['size']} bytes of data each, then padding for direct reads)",
        f"sizes      experts {format_bytes(info['experts_bytes'])}, backbone "
        f"{format_bytes(info['backbone_bytes'])}, total {format_bytes(info['total_bytes'])}",
        "components " + ", ".join(f"{c['name']} {c['dtype']}{c['shape']}" for c in r["components"]),
    ]
    if "streamed" in info:  # a download: nothing is converted, experts come from its shards
        st = info["streamed"]
        lines[0] = f"download   {info['path']}  (streamed from its shards, no vault)"
        lines.append(
            f"streams    {st['reads_per_expert']:g} reads per expert from {st['shards']} "
            f"shard(s); 'smoe convert' makes one read per expert, checksummed"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class BadRecord:
    layer: int
    expert: int
    index: int
    expected: int  # the manifest's checksum
    actual: int  # the bytes' checksum; -1: the record could not be read whole
    padding_at: int | None = None  # first nonzero byte outside the components, in the record

    @property
    def problems(self) -> list[str]:
        """What is wrong with the record: 'checksum' and/or 'padding'."""
        return (["checksum"] if self.actual != self.expected else []) + (
            ["padding"] if self.padding_at is not None else []
        )


def verify(vault: Vault, progress: Callable[[int, int], None] | None = None) -> list[BadRecord]:
    """Re-read every record whole: its checksum (the manifest's algorithm) over its first
    ``size`` bytes, and zeros in its padding (between components, and from ``size`` to
    ``stride``: the converter writes zeros there). Return the bad records; VaultError if
    experts.bin cannot be read."""
    try:
        return _verify(vault, progress)
    except OSError as e:
        raise VaultError(
            f"{vault.experts_path} is unreadable ({e.strerror}); check the disk, or convert "
            "the model again"
        ) from None


def _verify(vault: Vault, progress: Callable[[int, int], None] | None) -> list[BadRecord]:
    m = vault.manifest
    size, stride = m.record.size, m.record.stride
    checksum = hasher(m.checksum_algorithm)
    gaps = m.record.padding()
    zeros = bytes(max((end - start for start, end in gaps), default=0))
    buf = bytearray(stride)
    view = memoryview(buf)
    bad = []
    fd = os.open(vault.experts_path, os.O_RDONLY)
    try:
        for i in range(m.num_records):
            got = os.preadv(fd, [view], i * stride)
            actual = checksum(view[:size]) if got == stride else -1
            padding_at = None
            if got == stride:
                for start, end in gaps:
                    if view[start:end] != zeros[: end - start]:
                        padding_at = start + next(j for j, x in enumerate(view[start:end]) if x)
                        break
            if actual != m.checksums[i] or padding_at is not None:
                layer, expert = m.record_key(i)
                bad.append(BadRecord(layer, expert, i, m.checksums[i], actual, padding_at))
            if progress and (i % 64 == 63 or i == m.num_records - 1):
                progress(i + 1, m.num_records)
            # Checking must not push a big vault through the page cache.
            if hasattr(os, "posix_fadvise") and i % 64 == 63:
                os.posix_fadvise(fd, (i - 63) * stride, 64 * stride, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return bad


@dataclass(frozen=True)
class FileCheck:
    file: str
    status: str  # "ok", "bad", or "unchecked" (the manifest records no checksum for it)
    message: str  # what was found, and for "bad" and "unchecked" what to do


def verify_files(vault: Vault) -> list[FileCheck]:
    """The whole-file checksums: backbone.safetensors (hashed now, whatever stats/
    remembers) and config.json (read and checked again)."""
    checks = []
    if "checksum" not in vault.manifest.backbone:
        checks.append(_unchecked(BACKBONE_FILE))  # and no warning: this line says it
    else:
        try:
            vault.verify_backbone(force=True)
        except VaultError as e:
            checks.append(FileCheck(BACKBONE_FILE, "bad", str(e)))
        else:
            checks.append(FileCheck(BACKBONE_FILE, "ok", "matches its checksum"))
    try:
        vault.config()
    except VaultError as e:
        checks.append(FileCheck(CONFIG_FILE, "bad", str(e)))
    else:
        has = "checksum" in vault.manifest.config
        checks.append(
            FileCheck(CONFIG_FILE, "ok", "matches its checksum") if has else _unchecked(CONFIG_FILE)
        )
    # Each file copied from the source, one line each: a regular file inside the vault
    # (Vault.read_side_file refuses a link out of it or a FIFO), matching its checksum
    # where the vault records one (the manifest's validation requires one for each then).
    sums = vault.manifest.source.get("checksums") or {}
    for name in vault.side_files():
        try:
            vault.read_side_file(name)
        except VaultError as e:
            checks.append(FileCheck(name, "bad", str(e)))
        else:
            checks.append(
                FileCheck(name, "ok", "matches its checksum") if name in sums else _unchecked(name)
            )
    return checks


def _unchecked(name: str) -> FileCheck:
    return FileCheck(
        name,
        "unchecked",
        "has no checksum in the manifest (the vault was made before S-MoE recorded one); "
        "convert the model again to have it checked",
    )
