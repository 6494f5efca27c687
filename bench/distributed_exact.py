"""How close 2 ranks come to one process, bit for bit (JSON out).

    python bench/distributed_exact.py VAULT --slots 8 [--backend nccl] [--device gpu]

One process computes teacher-forced logits over a random prompt, greedy tokens, and the
decode path's logits with those tokens forced. Then two ranks (mlx.launch, the given
backend) do the same through tests/distributed_worker.py. Reports whether each is
bit-identical and, where not, the largest absolute difference and the tokens. On the CPU
the ranks are exact by construction (docs/distributed.md); on CUDA, parts of a layer may
round differently from the whole layer's call.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import harness
import numpy as np

from smoe.engine import Engine
from smoe.util.loop import run
from tests.exact.test_engine_exact import engine_decode, engine_generate

ROOT = harness.REPO


async def one_process(vault: str, slots: int, device: str | None, prompt: list[int], steps: int):
    async with Engine.open(vault, slots=slots, device=device) as engine:
        logits = await engine.logits(prompt)
        tokens = await engine_generate(engine, prompt, steps)
        step_logits, _ = await engine_decode(engine, prompt, tokens)
    return logits, tokens, np.stack(step_logits)


def diff(a: np.ndarray, b: np.ndarray) -> dict[str, object]:
    return {"bit_identical": bool(np.array_equal(a, b)), "max_abs": float(np.abs(a - b).max())}


def main() -> int:
    ap = harness.parser(__doc__)
    harness.vault(ap)
    ap.add_argument("--slots", type=int, required=True)
    ap.add_argument("--backend", default="ring")
    harness.device(ap)
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    prompt = np.random.default_rng(0).integers(2, 250, 70).tolist()
    logits, tokens, steps = run(one_process(a.vault, a.slots, a.device, prompt, a.steps))
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
        s.close()
        launch = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
        where = ["-p", port] if a.backend == "ring" else ["--nccl-port", port]
        cmd = [launch, "-n", "2", "--backend", a.backend, *where, "--", sys.executable]
        cmd += ["-m", "tests.distributed_worker", a.vault, tmp, str(a.slots)]
        cmd += [",".join(map(str, prompt)), str(a.steps), ",".join(map(str, tokens))]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise SystemExit(out.stderr[-3000:])
        ranks = []
        for r in range(2):
            got = np.load(Path(tmp) / f"rank{r}.npz")
            report = json.loads((Path(tmp) / f"rank{r}.json").read_text())
            ranks.append(
                {
                    "rank": r,
                    "prefill_logits": diff(got["logits"], logits),
                    "decode_logits": diff(got["steps"], steps),
                    "same_tokens": report["tokens"] == tokens,
                    "tokens": report["tokens"],
                }
            )
    harness.report(
        {
            "vault": a.vault,
            "slots": a.slots,
            "backend": a.backend,
            "device": a.device,
            "tokens": tokens,
            "ranks": ranks,
        },
        a,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
