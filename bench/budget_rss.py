"""Peak resident memory against --memory, inside a memory cgroup of exactly that size
(a container's hard limit, swap off), page cache dropped first (issue 30, item 9).

    python bench/budget_rss.py VAULT --memory 2.1e9 [--memory 3.2e9 ...]
                               [--max-tokens 32] [--max-context 512]

For each budget: `smoe generate VAULT --memory M` with a ~50-token prompt in a fresh cgroup
limited to M (tests/cgroup.py, root and a memory controller needed); prints JSON with the
process's peak RSS (VmHWM), the cgroup's peak charge (page cache included, which the kernel
reclaims at the limit), OOM kills, and peak RSS minus the budget.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import harness

from tests.cgroup import limited  # the tests' cgroup helper

REPO = harness.REPO

PEAK = (
    "import sys\nfrom smoe.cli import main\nrc = main(sys.argv[1:])\n"
    "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
    "print('PEAK', int(hwm.split()[1]) * 1024)\nsys.exit(rc)\n"
)
PROMPT = "In the beginning God created the heaven and the earth. " * 4


def one(vault: str, memory: int, max_tokens: int, context: int) -> dict:
    argv = ["generate", vault, "--prompt", PROMPT, "--ignore-chat-template"]
    argv += ["--max-tokens", str(max_tokens), "--memory", str(memory)]
    argv += ["--max-context", str(context), "--json"]
    subprocess.run(["sync"], check=False)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = limited(
        [sys.executable, "-c", PEAK, *argv], memory, capture_output=True, text=True, env=env
    )
    if run is None:
        raise SystemExit("cannot create a memory cgroup here (needs root and a memory controller)")
    r = run.result
    peak = int(r.stdout.split("PEAK")[-1]) if "PEAK" in r.stdout else None
    return {
        "memory": memory,
        "exit": r.returncode,
        "oom_kills": run.oom_kills,
        "peak_rss": peak,
        "rss_minus_budget": None if peak is None else peak - memory,
        "cgroup_peak": run.peak,
        "error": r.stderr[-400:] if r.returncode else None,
    }


def main() -> None:
    p = harness.parser(__doc__)
    harness.vault(p)
    harness.memory(p, type=float, action="append", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-context", type=int, default=512)
    a = p.parse_args()
    runs = [one(a.vault, int(m), a.max_tokens, a.max_context) for m in a.memory]
    harness.report({"benchmark": "budget_rss", "vault": a.vault, "runs": runs}, a)


if __name__ == "__main__":
    main()
