"""Expert parallelism: one process against N ranks with the same ring per rank (JSON out).

    python bench/distributed.py VAULT --slots 64 [--ranks 2] [--tokens 32] [--rounds 2]

Each round runs `smoe generate VAULT --slots S --json` in one process, then the same
under `mlx.launch -n N --backend ring` with `--distributed` (each rank: a ring of S slots
for its own experts), alternating which goes first (ABBA). Greedy, the same random
prompt. Reports per run: decode tok/s, time to first token, and per rank the bytes read
per generated token, the hit rate, and the time spent in the layer sums over ranks per
generated token (collectives, their waits for the slowest rank included). The ranks'
tokens must equal the single process's (checked).
"""

from __future__ import annotations

import json
import random
import shutil
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import harness

ROOT = harness.REPO


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_generate(args: list[str], ranks: int, backend: str = "ring") -> dict[str, Any]:
    cmd = [sys.executable, "-m", "smoe.cli", "generate", *args, "--json"]
    if ranks > 1:
        launch = shutil.which("mlx.launch") or Path(sys.executable).parent / "mlx.launch"
        port = str(_free_port())
        where = ["-p", port] if backend == "ring" else ["--nccl-port", port]
        cmd = [str(launch), "-n", str(ranks), "--backend", backend, *where, "--", *cmd]
        cmd += ["--distributed", backend]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    return dict(json.loads(lines[-1]))


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    s = report["stats"]
    generated = max(1, s["generated_tokens"])
    ranks = s.get("ranks") or [
        {
            "rank": 0,
            "bytes_read": s["bytes_read"],
            "hit_rate": s["hit_rate"],
            "collective_s": 0.0,
            "collectives": 0,
        }
    ]
    return {
        "decode_tok_s": round(s["decode_tok_s"], 3),
        "ttft_s": round(s["ttft_s"], 3),
        "ring_slots_per_rank": s["ring_slots"],
        "per_rank": [
            {
                "rank": r["rank"],
                "MB_read_per_token": round(r["bytes_read"] / generated / 1e6, 2),
                "hit_rate": round(r["hit_rate"], 3),
                "collective_ms_per_token": round(1e3 * r["collective_s"] / generated, 2),
                "collectives": r["collectives"],
            }
            for r in ranks
        ],
        "tokens": report["tokens"],
    }


def main() -> int:
    ap = harness.parser(__doc__)
    harness.vault(ap, type=Path)
    ap.add_argument("--slots", type=int, required=True, help="ring slots per rank")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=8)
    harness.rounds(ap, default=2)
    harness.workers(ap, default=4)
    harness.device(ap)
    ap.add_argument("--backend", default="ring", help="ring, or nccl for one rank per GPU")
    ap.add_argument(
        "--temp",
        type=float,
        default=0.0,
        help="sample at this temperature (seeded: both sides alike)",
    )
    a = ap.parse_args()
    prompt = ",".join(str(random.Random(0).randrange(10, 1000)) for _ in range(a.prompt))
    args = [str(a.vault), "--prompt-ids", prompt, "--max-tokens", str(a.tokens)]
    args += ["--slots", str(a.slots), "--workers", str(a.workers)]
    args += ["--device", a.device] if a.device else []
    args += ["--temp", str(a.temp), "--seed", "1"] if a.temp > 0 else []
    runs: dict[str, list[dict[str, Any]]] = {"1": [], str(a.ranks): []}
    for r in range(a.rounds):
        order = [1, a.ranks] if r % 2 == 0 else [a.ranks, 1]
        for n in order:
            runs[str(n)].append(summarize(run_generate(args, n, a.backend)))
    solo = runs["1"][0]["tokens"]
    same = all(run["tokens"] == solo for rs in runs.values() for run in rs)
    rates = {n: statistics.median(x["decode_tok_s"] for x in rs) for n, rs in runs.items()}
    harness.report(
        {
            "benchmark": "distributed",
            "vault": str(a.vault),
            "slots_per_rank": a.slots,
            "ranks": a.ranks,
            "device": a.device or "default",
            "backend": a.backend,
            "temperature": a.temp,
            "tokens": a.tokens,
            "same_tokens": same,
            "median_decode_tok_s": rates,
            "speedup": round(rates[str(a.ranks)] / rates["1"], 3),
            "runs": {
                n: [{k: v for k, v in x.items() if k != "tokens"} for x in rs]
                for n, rs in runs.items()
            },
        },
        a,
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
