"""Conversion throughput and peak memory: `python bench/convert_throughput.py SRC VAULT [opts]`.

Runs `smoe convert` in a child process (so peak RSS is the converter's own) and prints one
JSON object: source bytes, seconds, MB/s of source, peak RSS, record size and count.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import harness


def main() -> int:
    p = harness.parser(__doc__)
    p.add_argument("src", type=Path)
    p.add_argument("vault", type=Path)
    p.add_argument(
        "convert_args",
        nargs=argparse.REMAINDER,
        help="extra `smoe convert` options, e.g. --bits 4 --group-size 64",
    )
    args = p.parse_args()
    cmd = [
        sys.executable,
        "-m",
        "smoe.cli",
        "convert",
        str(args.src),
        str(args.vault),
        "--force",
        "--quiet",
        *args.convert_args,
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        print(proc.stderr, file=sys.stderr)
        return proc.returncode
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    manifest = json.loads((args.vault / "manifest.json").read_text())
    src_bytes = manifest["source"]["bytes"]
    harness.report(
        {
            "source": str(args.src),
            "source_bytes": src_bytes,
            "seconds": round(seconds, 2),
            "source_MB_per_s": round(src_bytes / 1e6 / seconds, 1),
            "peak_rss_bytes": peak_kib * 1024,
            "record_size": manifest["record"]["size"],
            "record_stride": manifest["record"]["stride"],
            "records": manifest["experts"]["count"],
            "experts_bytes": manifest["experts"]["bytes"],
            "quantization": manifest["quantization"],
            "options": args.convert_args,
        },
        args,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
