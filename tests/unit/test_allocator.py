"""What glibc's malloc keeps beside the memory in use, bounded under a --memory budget
(smoe.util.allocator, issue 49). Each case runs in a fresh process: malloc's settings are
the process's, and cannot be undone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

try:
    GLIBC = os.confstr("CS_GNU_LIBC_VERSION") is not None
except (ValueError, OSError, AttributeError):
    GLIBC = False
pytestmark = pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")

# 64 blocks of 2 MiB written and freed, all but the last, which pins the heap's top (a
# live block above them, as the engine's arrays are); then 8 threads that each allocate.
# Prints the anonymous resident set kept after the free and the arenas malloc made.
CHURN = r"""
import ctypes, json, sys, threading
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "bounded":
    from smoe.util.allocator import bound_malloc
    assert bound_malloc()

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

MiB = 1 << 20
BLOCK = 2 * MiB
libc.free(libc.malloc(BLOCK))  # left alone, glibc's mmap threshold now rises past it
base = anon()
blocks = [libc.malloc(BLOCK) for _ in range(64)]
for b in blocks:
    ctypes.memset(b, 1, BLOCK)
for b in blocks[:-1]:
    libc.free(b)
kept = anon() - base

held, go = [], threading.Barrier(9)
def work():
    go.wait()  # all at once: each thread's first malloc looks for an arena
    held.append(libc.malloc(4096))
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads:
    t.start()
go.wait()
for t in threads:
    t.join()
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
path = sys.argv[2].encode()
f = libc.fopen(path, b"w")
libc.malloc_info(0, f)
libc.fclose(f)
arenas = open(path).read().count("<heap nr=")
print(json.dumps({"kept": kept, "arenas": arenas}))
"""


def _churn(mode: str, tmp_path: Path) -> dict[str, int]:
    r = subprocess.run(
        [sys.executable, "-c", CHURN, mode, str(tmp_path / f"{mode}.xml")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_freed_blocks_go_back_and_arenas_are_capped(tmp_path):
    """Left alone, glibc keeps 63 freed 2 MiB blocks resident below a live one (its
    threshold rose when the first was freed; smoe generate ended with 60-70 MB of such
    free space, an amount that varied with the threads' timing), and gives each thread
    that allocates its own arena. After ``bound_malloc`` the freed blocks leave the
    resident set and the threads share at most ARENA_MAX arenas."""
    from smoe.util.allocator import ARENA_MAX

    free = _churn("free", tmp_path)
    bounded = _churn("bounded", tmp_path)
    assert free["kept"] >= 96 << 20 and free["arenas"] > ARENA_MAX, free  # what it fixes
    assert bounded["kept"] <= 4 << 20, bounded
    assert bounded["arenas"] <= ARENA_MAX, bounded
