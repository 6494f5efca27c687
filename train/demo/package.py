"""Copy a trained run into the package as the built-in demo model (smoe/chat/demo_model/).

The shards are merged into one model.safetensors (git and the wheel carry one 25 MB file
more easily than several); the tokenizer is prepare.py's; summary.json and the loss log
go along so `smoe chat` can say what it runs.

    python -m train.demo.package RUN_DIR .train/tokenizer smoe/chat/demo_model
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# What `smoe chat` samples with by default: greedy decoding repeats the corpus's most
# frequent verse ("And the LORD spake unto Moses, saying,"); sampling reads like the book.
SUGGESTED_SAMPLING = {"do_sample": True, "temperature": 0.8, "top_p": 0.95}
FILES_FROM_TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def released_form(config: dict) -> dict:
    """config.json as the released Qwen3-MoE checkpoints spell it (num_experts, rope_theta),
    which every reader accepts; transformers 5 writes num_local_experts and rope_parameters."""
    config = dict(config)
    if "num_local_experts" in config:
        config["num_experts"] = config.pop("num_local_experts")
    rope = config.pop("rope_parameters", None) or {}
    config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    config["rope_scaling"] = None
    return dict(sorted(config.items()))


def main(run_dir: str, tokenizer_dir: str, out_dir: str) -> None:
    run, out = Path(run_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors*"):
        stale.unlink()
    # safetensors.numpy has no bfloat16; torch's does, and torch is on the training path.
    import torch
    from safetensors.torch import load_file as load_torch
    from safetensors.torch import save_file as save_torch

    merged = {}
    for shard in sorted((run / "model").glob("*.safetensors")):
        merged |= load_torch(str(shard))
    save_torch(
        dict(sorted(merged.items())), str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    config = json.loads((run / "model" / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(released_form(config), indent=2) + "\n")
    generation = json.loads((run / "model" / "generation_config.json").read_text())
    generation |= SUGGESTED_SAMPLING
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    copies = [(Path(tokenizer_dir) / name, name) for name in FILES_FROM_TOKENIZER]
    copies += [
        (run / "summary.json", "training.json"),
        (run / "train_log.jsonl", "train_log.jsonl"),
    ]
    for source, name in copies:
        (out / name).write_bytes(source.read_bytes())  # not copy(): the run's files are read-only
    size = sum(p.stat().st_size for p in out.iterdir())
    print(
        json.dumps(
            {
                "tensors": len(merged),
                "bytes": size,
                "dtype": str(next(iter(merged.values())).dtype),
                "torch": torch.__version__,
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
