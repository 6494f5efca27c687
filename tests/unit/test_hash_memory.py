"""Hashing a vault file takes a buffer's memory, not the file's (issue 30, item 9): the
backbone's checksum was taken over a mapping of the whole file, whose pages counted in the
process's resident set, so a 722 MB backbone pushed an 18-layer run 38-42 MB over its
--memory under a cgroup (bench/capped_prompt.py). Measured in a fresh process: its peak
resident set (VmHWM) after hashing a 256 MB file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HASH_AND_PEAK = (
    "import sys\n"
    "from smoe.vault.format import file_checksum\n"
    "def hwm():\n"
    "    line = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
    "    return int(line.split()[1]) * 1024\n"
    "before = hwm()\n"
    "file_checksum(sys.argv[1])\n"
    "print(hwm() - before)\n"
)


def test_hashing_a_file_does_not_hold_it_in_memory(tmp_path):
    big = tmp_path / "backbone.safetensors"
    with open(big, "wb") as f:
        for _ in range(256):
            f.write(os.urandom(1 << 20))
    out = subprocess.run(
        [sys.executable, "-c", HASH_AND_PEAK, str(big)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=True,
    )
    grew = int(out.stdout.strip())
    assert grew < 16 << 20, f"hashing 256 MB raised the peak resident set by {grew} bytes"
