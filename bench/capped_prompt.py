"""A cold prompt under a memory cap, this checkout against another commit, in one run:
`smoe generate VAULT --memory M` inside a memory cgroup of the cap (swap off), page cache
dropped before each run, rounds alternating old/new and new/old (ABBA). Reports time to
first token, prefill and decode tok/s, bytes read and peak RSS per run (JSON out).

    python bench/capped_prompt.py VAULT --memory 2100MB --cap 2.2e9 --old COMMIT
                                  [--rounds 2] [--max-tokens 16] [--max-context 512]

Needs root and a memory controller (tests/cgroup.py). The prompt is fixed text: the same
tokens on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import harness

from tests.cgroup import limited  # the tests' cgroup helper

REPO = harness.REPO

PROMPT = (
    "In the beginning God created the heaven and the earth. And the earth was without form, "
    "and void; and darkness was upon the face of the deep. And the Spirit of God moved upon "
    "the face of the waters. And God said, Let there be light: and there was light."
)
PEAK = (
    "import sys\nfrom smoe.cli import main\nrc = main(sys.argv[1:])\n"
    "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
    "print('PEAK', int(hwm.split()[1]) * 1024)\nsys.exit(rc)\n"
)


def one(repo: Path, a: argparse.Namespace) -> dict:
    argv = ["generate", a.vault, "--prompt", PROMPT, "--ignore-chat-template", "--json"]
    argv += ["--max-tokens", str(a.max_tokens), "--memory", a.memory]
    argv += ["--max-context", str(a.max_context)]
    subprocess.run(["sync"], check=False)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    env = {**os.environ, "PYTHONPATH": str(repo)}
    run = limited(
        [sys.executable, "-c", PEAK, *argv],
        int(float(a.cap)),
        capture_output=True,
        text=True,
        env=env,
        cwd=str(repo),
    )
    if run is None:
        raise SystemExit("cannot create a memory cgroup here (needs root and a memory controller)")
    r = run.result
    if r.returncode != 0:
        return {"exit": r.returncode, "oom_kills": run.oom_kills, "error": r.stderr[-800:]}
    report = json.loads(r.stdout.split("PEAK")[0].strip().splitlines()[-1])
    st = report["stats"]
    keep = ("prompt_tokens", "ttft_s", "prefill_tok_s", "decode_tok_s", "bytes_read")
    return {
        **{k: st.get(k) for k in keep},
        "peak_rss": int(r.stdout.split("PEAK")[-1]),
        "oom_kills": run.oom_kills,
    }


def main() -> None:
    p = harness.parser(__doc__)
    harness.vault(p)
    harness.memory(p, required=True)
    p.add_argument("--cap", required=True, help="the cgroup's limit in bytes")
    p.add_argument("--old", required=True, help="the commit to compare against")
    harness.rounds(p, default=2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-context", type=int, default=512)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(old), a.old],
            check=True,
            capture_output=True,
        )
        try:
            runs: dict[str, list[dict]] = {"old": [], "new": []}
            for i in range(a.rounds):
                order = ["old", "new"] if i % 2 == 0 else ["new", "old"]
                for side in order:
                    runs[side].append(one(old if side == "old" else REPO, a))
                    print(json.dumps({side: runs[side][-1]}), file=sys.stderr, flush=True)
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(old)],
                check=False,
                capture_output=True,
            )

    def median(side: str, key: str) -> float | None:
        vals = [r[key] for r in runs[side] if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    ratios = {}
    for key in ("ttft_s", "prefill_tok_s", "decode_tok_s"):
        o, n = median("old", key), median("new", key)
        ratios[key] = round(n / o, 3) if o and n else None
    harness.report(
        {
            "benchmark": "capped_prompt",
            "vault": a.vault,
            "memory": a.memory,
            "cap": a.cap,
            "old": a.old,
            "runs": runs,
            "median_ratio_new_over_old": ratios,
        },
        a,
    )


if __name__ == "__main__":
    main()
