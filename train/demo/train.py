"""Train the demo MoE (a small Qwen3-MoE) on prepare.py's token stream, with torch.

Runs on one CUDA GPU (bf16 autocast, fp32 master weights) or, slowly, on the CPU. The step
count is either given (--steps) or fitted to --budget-s from the speed of the first steps;
the log records it, so `--steps N --seed S` reproduces a run. The checkpoint with the best
held-out loss is saved in bfloat16, sharded under 14 MB, as a Hugging Face model folder.

    python -m train.demo.train --data .train --out OUT [--budget-s 420 | --steps N]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

# Shaped so experts matter (32 of them, top-4, in all 6 layers) while the bf16 checkpoint
# stays near 25 MB: 12.5M parameters, 9.4M of them in experts.
GEOMETRY = dict(
    vocab_size=4096,
    hidden_size=256,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=512,
    moe_intermediate_size=64,
    num_experts=32,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=2048,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=0,
)
SEQ = 512


def config(**over: object) -> Qwen3MoeConfig:
    c = Qwen3MoeConfig(**{**GEOMETRY, **over})
    c.num_experts = GEOMETRY["num_experts"]  # transformers 5 names it num_local_experts
    return c


def windows(tokens: np.ndarray, starts: np.ndarray, device: torch.device) -> torch.Tensor:
    idx = starts[:, None] + np.arange(SEQ + 1)[None, :]
    return torch.from_numpy(tokens[idx].astype(np.int64)).to(device)


@torch.no_grad()
def held_out_loss(model: Qwen3MoeForCausalLM, held: np.ndarray, device: torch.device) -> float:
    """Mean next-token loss over non-overlapping windows of the held-out text."""
    model.eval()
    starts = np.arange(0, len(held) - SEQ - 1, SEQ)
    total, count = 0.0, 0
    for i in range(0, len(starts), 16):
        batch = windows(held, starts[i : i + 16], device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=batch[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total, count = total + loss.item(), count + batch[:, 1:].numel()
    model.train()
    return total / count


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=0, help="0: fit to --budget-s")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--evals", type=int, default=20)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokens = np.load(args.data / "train_tokens.npy")
    held = np.load(args.data / "held_out_tokens.npy")
    model = Qwen3MoeForCausalLM(config(output_router_logits=True, router_aux_loss_coef=0.01))
    model.to(device).train()
    params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    rng = np.random.default_rng(args.seed)
    warmup, total = 100, args.steps or 10**9
    args.out.mkdir(parents=True, exist_ok=True)
    best, best_state, started, step = math.inf, None, time.perf_counter(), 0
    eval_every = max(1, (args.steps or 1000) // args.evals)
    with open(args.out / "train_log.jsonl", "w") as log:
        while step < total:
            if step == 30 and not args.steps:  # fit the schedule to the budget
                per_step = (time.perf_counter() - started) / 30
                total = int(args.budget_s / per_step)
                eval_every = max(1, total // args.evals)
            lr = args.lr * min(1.0, (step + 1) / warmup)
            if step >= warmup and total < 10**9:  # cosine to 10%
                lr *= 0.1 + 0.9 * 0.5 * (
                    1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))
                )
            for g in opt.param_groups:
                g["lr"] = lr
            batch = windows(tokens, rng.integers(0, len(tokens) - SEQ - 1, args.batch), device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                out = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone())
            # labels are shifted inside the model; the last input token predicts nothing.
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            if step % eval_every == 0 or step == total:
                held_loss = held_out_loss(model, held, device)
                row = {
                    "step": step,
                    "seconds": round(time.perf_counter() - started, 1),
                    "tokens": step * args.batch * SEQ,
                    "lr": lr,
                    "train_loss": out.loss.item(),
                    "aux_loss": float(out.aux_loss)
                    if getattr(out, "aux_loss", None) is not None
                    else 0.0,
                    "held_out_loss": held_loss,
                    "held_out_ppl": math.exp(held_loss),
                }
                log.write(json.dumps(row) + "\n")
                log.flush()
                print(json.dumps(row), flush=True)
                if held_loss < best:
                    best = held_loss
                    best_state = {
                        k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()
                    }
    assert best_state is not None
    final = Qwen3MoeForCausalLM(config())
    final.load_state_dict(best_state)
    final.to(torch.bfloat16).save_pretrained(args.out / "model", max_shard_size="14MB")
    summary = {
        "parameters": params,
        "steps": total,
        "batch": args.batch,
        "seq": SEQ,
        "seed": args.seed,
        "lr": args.lr,
        "seconds": round(time.perf_counter() - started, 1),
        "best_held_out_loss": best,
        "best_held_out_ppl": math.exp(best),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
