"""What MLX's CUDA backend does with a staged ring, measured (docs/gpu.md quotes the output).

    python bench/gpu_probe.py [--dir /tmp/probe] > probe.json

1. commits: landed records copied into device arrays in place (memory counters), right
   bytes in the slots, and the time per 10.6 MB record (Qwen3-235B 4-bit geometry);
2. landings: O_DIRECT straight into a managed-memory landing buffer, and through a bounce
   buffer, each followed by the GPU copy and a check of every byte, many rewrites of one
   landing (stale data would show as mismatches);
3. offsets: gather_qmm / gather_mm on arrays past 2^31 bytes and 2^31 elements, at the
   last slots, against the same slots stacked alone (whether banks must split by bytes or
   by elements).
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import harness
import mlx.core as mx
import numpy as np

from smoe.io.direct_file import open_direct
from smoe.io.staged import StagedRing
from smoe.vault.layout import RecordLayout

Q235 = RecordLayout.build(
    [
        (f"{p}.{part}", dtype, shape)
        for p, (o, i) in (
            ("down_proj", (4096, 1536)),
            ("gate_proj", (1536, 4096)),
            ("up_proj", (1536, 4096)),
        )
        for part, dtype, shape in (
            ("weight", "uint32", (o, i // 8)),
            ("scales", "bfloat16", (o, i // 64)),
            ("biases", "bfloat16", (o, i // 64)),
        )
    ]
)


def records_file(path: Path, layout: RecordLayout, n: int) -> list[bytes]:
    """n random records (valid bf16 scales) written to ``path``; returns their bytes."""
    rng = np.random.default_rng(0)
    out = []
    with open(path, "wb") as f:
        for _ in range(n):
            rec = np.zeros(layout.stride, np.uint8)
            for c in layout.components:
                if c.dtype == "bfloat16":
                    vals = (rng.standard_normal(c.nbytes // 2) * 0.01).astype(np.float32)
                    raw = (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
                else:
                    raw = rng.integers(0, 256, c.nbytes, dtype=np.uint8)
                rec[c.offset : c.offset + c.nbytes] = raw
            f.write(rec.tobytes())
            out.append(rec.tobytes())
    return out


def slot_crc(ring: StagedRing, slot: int, layout: RecordLayout) -> int:
    """CRC32 of a slot's components, read back from the device (bf16 as stored)."""
    bank, local = ring.locate(slot)
    arrays = ring.banks()[bank]
    crc = 0
    rec = np.zeros(layout.stride, np.uint8)
    for c in layout.components:
        a = arrays[c.name][local]  # a gather: a new small array, the bank stays on device
        raw = np.array(a.view(mx.uint8) if a.dtype != mx.uint8 else a).reshape(-1)
        rec[c.offset : c.offset + c.nbytes] = raw
    crc = zlib.crc32(rec[: layout.size])
    return crc


def probe_commits(dirpath: Path, host: bool, bounce: bool, rounds: int) -> dict[str, Any]:
    layout = Q235
    n = 8
    path = dirpath / "records.bin"
    recs = records_file(path, layout, n)
    want = [zlib.crc32(r[: layout.size]) for r in recs]
    ring = StagedRing(layout, 64, mx.bfloat16, landings=2, gpu_landings=host, bounce=bounce)
    fd, direct = open_direct(path)
    mismatches = 0
    read_s = commit_s = 0.0
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    try:
        for r in range(rounds):
            record, slot = r % n, (7 * r) % 64
            t0 = time.perf_counter()
            with ring.landing(slot) as mem:
                done = 0
                while done < layout.stride:
                    done += os.preadv(fd, [mem[done:]], record * layout.stride + done)
            t1 = time.perf_counter()
            ring.commit()
            t2 = time.perf_counter()
            read_s += t1 - t0
            commit_s += t2 - t1
            if slot_crc(ring, slot, layout) != want[record]:
                mismatches += 1
    finally:
        os.close(fd)
    mx.synchronize()
    return {
        "landings_kept_on_host": ring.landings_on_host,
        "bounce": bounce,
        "direct_io": direct,
        "rounds": rounds,
        "mismatches": mismatches,
        "ring_bytes": ring.nbytes,
        "active_memory_growth": int(mx.get_active_memory() - before),
        "peak_above_start": int(mx.get_peak_memory() - before),
        "read_ms_per_record": round(1e3 * read_s / rounds, 3),
        "commit_ms_per_record": round(1e3 * commit_s / rounds, 3),
        "commit_GBps": round(layout.stride * rounds / commit_s / 1e9, 2),
    }


def probe_offsets() -> dict[str, Any]:
    """gather_qmm over [S, 1536, 512] uint32 (4-bit [1536, 4096]) at the last 8 slots,
    against a fresh contiguous copy of those slots: where do the kernels' offsets wrap?
    2^31 unpacked 4-bit values are 341.3 slots; 2^31 bytes are 682.7 slots."""
    out: dict[str, Any] = {}
    x = mx.random.normal((1, 1, 1, 4096)).astype(mx.bfloat16)
    for slots in (300, 340, 344, 680, 688, 1024):
        try:
            w = mx.random.randint(0, 2**31, (slots, 1536, 512)).astype(mx.uint32)
            s = (mx.random.normal((slots, 1536, 64)) * 0.01).astype(mx.bfloat16)
            b = (mx.random.normal((slots, 1536, 64)) * 0.01).astype(mx.bfloat16)
            mx.eval(w, s, b)
            ws, ss, bs = w[slots - 8 :] + 0, s[slots - 8 :] * 1, b[slots - 8 :] * 1  # copies
            mx.eval(ws, ss, bs)
            row: dict[str, Any] = {"weight_bytes": int(w.nbytes)}
            for n in (8, 4):  # 8 rows: the tiled kernel; 4: the matrix-vector one
                got = mx.gather_qmm(
                    x,
                    w,
                    s,
                    b,
                    rhs_indices=mx.array([list(range(slots - n, slots))], mx.uint32),
                    transpose=True,
                    group_size=64,
                    bits=4,
                )
                ref = mx.gather_qmm(
                    x,
                    ws,
                    ss,
                    bs,
                    rhs_indices=mx.array([list(range(8 - n, 8))], mx.uint32),
                    transpose=True,
                    group_size=64,
                    bits=4,
                )
                row[f"equal_{n}_rows"] = bool(mx.array_equal(got, ref).item())
            out[f"gather_qmm_{slots}_slots"] = row
            del w, s, b, ws, ss, bs
        except Exception as e:  # reported, not fatal: this is what the probe is for
            out[f"gather_qmm_{slots}_slots"] = {"error": str(e)[:300]}
        mx.clear_cache()
    return out


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--dir", type=Path, default=Path("/tmp/smoe-probe"))
    harness.rounds(p, default=200)
    args = p.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "device_info": {k: v for k, v in mx.device_info().items() if isinstance(v, (int, str))},
    }
    for name, host, bounce in (
        ("managed_direct", False, False),
        ("host_direct", True, False),
        ("host_bounce", True, True),
    ):
        report[f"commits_{name}"] = probe_commits(args.dir, host, bounce, args.rounds)
        print(json.dumps(report[f"commits_{name}"]), file=sys.stderr, flush=True)
    report["offsets"] = probe_offsets()
    harness.report(report, args)


if __name__ == "__main__":
    main()
