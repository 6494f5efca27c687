"""The loss curves of training runs (train.py's train_log.jsonl), as one PNG.

python -m train.demo.plot OUT.png LABEL=RUN/train_log.jsonl [LABEL=...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(out: str, *runs: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for i, run in enumerate(runs):
        label, path = run.split("=", 1)
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        tokens = [r["tokens"] / 1e6 for r in rows]
        color = f"C{i}"
        ax.plot(
            tokens, [r["train_loss"] for r in rows], color=color, ls="--", label=f"{label}: train"
        )
        ax.plot(
            tokens,
            [r["held_out_loss"] for r in rows],
            color=color,
            marker="o",
            ms=3,
            label=f"{label}: held out",
        )
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("loss (nats per token)")
    ax.set_ylim(0, 6)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("demo model: King James Bible, 12.6M-parameter Qwen3-MoE, H200")
    fig.tight_layout()
    fig.savefig(out)
    print(out)


if __name__ == "__main__":
    main(*sys.argv[1:])
