"""Prompt-lookup drafting (--draft ngram) against plain decode, greedy, on one vault.

    python bench/draft.py VAULT [--memory 25%] [--tokens 64] [--trials 2] [--draft-tokens 4]

Two tasks: "repeat", a prompt that repeats a passage (the KJV held-out text with a
tokenizer; else 48 random ids four times), continued from the passage's start; "free", a
prompt with nothing to look up (a chat question; else 192 distinct random ids). Each trial
opens a fresh engine (a cold ring of the same size) per mode, alternating plain and draft
(ABAB), and generates the same tokens (checked). Reports per task and mode: decode tok/s,
expert bytes read per generated token, and the drafter's counters (verify passes,
acceptance, plain steps, switch-offs: the governor turning drafting off when it does not
pay). ``--memory N%`` is a share of the vault's experts. Prints JSON.
"""

import argparse
import asyncio
import json
import random
import statistics
from pathlib import Path

import smoe.util.loop
from smoe.engine import Engine
from smoe.vault.format import Vault

KJV = Path(__file__).resolve().parent.parent / "tests" / "data" / "kjv_held_out.txt"


def prompts(vault: Vault, engine_tokenizer) -> dict[str, list[int]]:
    """The two tasks' prompt ids."""
    if engine_tokenizer is not None:
        passage = KJV.read_text(encoding="utf-8")[:700].rsplit(" ", 1)[0]
        opening = " ".join(passage.split()[:10])
        free = [{"role": "user", "content": "Who was Moses, and what did he do?"}]
        chat = engine_tokenizer._tokenizer.apply_chat_template(
            free, add_generation_prompt=True, tokenize=False
        )
        return {
            "repeat": engine_tokenizer.encode(f"{passage} {passage} {opening}"),
            "free": engine_tokenizer.encode(chat),
        }
    rng = random.Random(0)
    vocab = vault.manifest.shape.vocab_size
    piece = rng.sample(range(vocab), 48)
    return {"repeat": piece * 4 + piece[:8], "free": rng.sample(range(vocab), 192)}


def ring_budget(vault: Vault, memory: str | None) -> str | None:
    if memory is None or not memory.endswith("%"):
        return memory
    m = vault.manifest
    return str(int(m.num_records * m.record.stride * float(memory[:-1]) / 100))


async def one(vault: str, memory: str | None, ids: list[int], tokens: int, draft: int | None):
    options = {"draft": "ngram", "draft_tokens": draft} if draft else {}
    async with Engine.open(vault, memory=memory, **options) as engine:
        out, stats = [], None
        async for event in engine.generate(ids, max_tokens=tokens, stop_at_eos=False):
            if event.token is not None:
                out.append(event.token)
            if event.stats is not None:
                stats = event.stats
        assert stats is not None
        drafting = engine.runner.drafting
        return out, {
            "decode_tok_s": stats.decode_tok_s,
            "bytes_per_token": stats.bytes_read / max(len(out), 1),
            "decode_bytes_per_token": stats.decode_bytes_per_token,
            "slots": engine.ring.num_slots,
            **({"draft": drafting.stats.to_json()} if drafting is not None else {}),
        }


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("vault")
    p.add_argument("--memory", default="25%")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--tasks", default="repeat,free")
    args = p.parse_args()
    vault = Vault.open(args.vault)
    memory = ring_budget(vault, args.memory)
    async with Engine.open(args.vault, memory=memory) as probe:
        tasks = prompts(vault, probe.tokenizer)
    report: dict = {"vault": args.vault, "memory": args.memory, "ring_bytes": memory}
    report.update(tokens=args.tokens, draft_tokens=args.draft_tokens, tasks={})
    for task in args.tasks.split(","):
        ids = tasks[task]
        runs: dict[str, list[dict]] = {"plain": [], "draft": []}
        outputs = set()
        for _ in range(args.trials):
            for mode in ("plain", "draft"):
                k = args.draft_tokens if mode == "draft" else None
                out, row = await one(args.vault, memory, ids, args.tokens, k)
                outputs.add(tuple(out))
                runs[mode].append(row)
        summary = {}
        for mode, rows in runs.items():
            summary[mode] = {
                "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rows),
                "bytes_per_token": statistics.median(r["bytes_per_token"] for r in rows),
                "trials": rows,
            }
        summary["speedup"] = summary["draft"]["decode_tok_s"] / summary["plain"]["decode_tok_s"]
        summary["identical_tokens"] = len(outputs) == 1
        summary["prompt_tokens"] = len(ids)
        report["tasks"][task] = summary
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    smoe.util.loop.run(main())
