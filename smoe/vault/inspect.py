"""`smoe inspect`: summarise a vault, and re-check every record's checksum."""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from smoe.units import format_bytes
from smoe.vault.format import Vault


def summary(vault: Vault) -> dict[str, Any]:
    """The facts `smoe inspect --json` prints."""
    m = vault.manifest
    return {
        "path": str(vault.path),
        "format": m.format,
        "version": m.version,
        "producer": m.producer,
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
        "backbone_bytes": vault.backbone_path.stat().st_size,
        "total_bytes": sum(p.stat().st_size for p in vault.path.rglob("*") if p.is_file()),
    }


def render(info: dict[str, Any]) -> str:
    """A human-readable summary."""
    t, q, r = info["topology"], info["quantization"], info["record"]

    def quant(x: dict[str, Any] | None) -> str:
        if not x:
            return "float (unquantized)"
        how = f"{x.get('mode', 'affine')} {x['bits']}-bit, group {x['group_size']}"
        return how + (" (copied from the MLX source)" if x.get("copied_from_source") else "")

    lines = [
        f"vault      {info['path']}  (format v{info['version']}, {info['producer']})",
        f"model      {t['model_type']}: {t['num_layers']} layers, hidden {t['hidden_size']}, "
        f"vocab {t['vocab_size']}",
        f"experts    {t['num_experts']} per MoE layer, top-{t['experts_per_token']}, "
        f"{t['expert_kind']} hidden {t['expert_hidden_size']}, "
        f"{len(t['moe_layers'])} MoE layers, shared experts {t['shared_experts']}",
        f"quantized  experts: {quant(q['experts'])}; backbone: {quant(q['backbone'])}",
        f"records    {r['count']} x {format_bytes(r['size'])} "
        f"(stride {format_bytes(r['stride'])}, {r['size']} bytes)",
        f"sizes      experts {format_bytes(info['experts_bytes'])}, backbone "
        f"{format_bytes(info['backbone_bytes'])}, total {format_bytes(info['total_bytes'])}",
        "components " + ", ".join(f"{c['name']} {c['dtype']}{c['shape']}" for c in r["components"]),
    ]
    return "\n".join(lines)


@dataclass(frozen=True)
class BadRecord:
    layer: int
    expert: int
    index: int
    expected: int
    actual: int


def verify(vault: Vault, progress: Callable[[int, int], None] | None = None) -> list[BadRecord]:
    """Re-read every record and compare its CRC32 with the manifest's; return the bad ones."""
    m = vault.manifest
    size, stride = m.record.size, m.record.stride
    buf = bytearray(size)
    view = memoryview(buf)
    bad = []
    fd = os.open(vault.experts_path, os.O_RDONLY)
    try:
        for i in range(m.num_records):
            got = os.preadv(fd, [view], i * stride)
            crc = zlib.crc32(view[:got]) if got == size else -1
            if crc != m.checksums[i]:
                layer, expert = m.record_key(i)
                bad.append(BadRecord(layer, expert, i, m.checksums[i], crc))
            if progress and (i % 64 == 63 or i == m.num_records - 1):
                progress(i + 1, m.num_records)
            # Checking must not push a big vault through the page cache.
            if hasattr(os, "posix_fadvise") and i % 64 == 63:
                os.posix_fadvise(fd, (i - 63) * stride, 64 * stride, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return bad
