"""Prompt-lookup drafting (--draft ngram) against plain decode, greedy, on one vault.

    python bench/draft.py VAULT [--ring 25%] [--device cpu|gpu] [--tokens 64] [--trials 2]
        [--draft-tokens 4] [--modes plain,ngram,oracle,wrong]

Two tasks: "repeat", a prompt that repeats a passage (the KJV held-out text with a
tokenizer; else 16 random ids three times), continued from the passage's start; "free", a
prompt with nothing to look up (a chat question; else 48 distinct random ids). Each trial
opens a fresh engine (a cold ring of the same size) per mode, alternating the modes
(plain, ngram, ...), and generates the same tokens (checked). ``--modes`` adds two
controlled drafters: "oracle" drafts the plain run's own continuation and is never switched
off (what verifying k accepted tokens costs: the most drafting can gain here), "wrong"
never drafts what the model says (the switch-off at work). Reports per task and mode:
decode tok/s, expert bytes read per decoded token, and the drafter's counters (verify
passes, acceptance, plain steps, switch-offs). ``--ring`` sizes the ring alone, as `smoe
bench`'s budgets do (a share of the experts like 25%, 'all', or a size). Prints JSON.
"""

import json
import random
import statistics
import sys
from pathlib import Path

import harness

import smoe.util.loop
from smoe.bench.generate import ring_options
from smoe.compute.draft import DraftGovernor, Drafting
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
    piece = rng.sample(range(vocab), 16)
    return {"repeat": piece * 3 + piece[:4], "free": rng.sample(range(vocab), 48)}


class Oracle:
    """Drafts the plain run's own continuation: every draft accepted (the upper bound)."""

    def __init__(self, truth: list[int], vocab: int, wrong: bool = False) -> None:
        self.truth, self.vocab, self.wrong = truth, vocab, wrong

    def propose(self, tokens: list[int], k: int) -> list[int]:
        nxt = self.truth[len(tokens) : len(tokens) + k]
        # wrong: never what the model says (a forced non-repetitive stream)
        return [(t + 1) % self.vocab if self.wrong else t for t in nxt]


def drafting_for(mode: str, truth: list[int], vocab: int, k: int) -> Drafting | None:
    """plain: none; ngram: --draft ngram; oracle: every draft right and the governor never
    switching off (what verifying k accepted tokens costs); wrong: every draft wrong, governed
    (the switch-off at work)."""
    if mode == "plain":
        return None
    if mode == "ngram":
        return Drafting.named("ngram", k)
    if mode == "oracle":
        return Drafting(Oracle(truth, vocab), k, governor=lambda: DraftGovernor(min_passes=10**9))
    return Drafting(Oracle(truth, vocab, wrong=True), k)


async def one(vault: str, ring: dict, ids: list[int], tokens: int, drafting):
    options = {"draft": "ngram"} if drafting is not None else {}
    async with Engine.open(vault, **ring, **options) as engine:
        engine.debug.runner.drafting = drafting  # the engine's drafted steps use it
        out, stats = [], None
        async for event in engine.generate(ids, max_tokens=tokens, stop_at_eos=False):
            if event.token is not None:
                out.append(event.token)
            if event.stats is not None:
                stats = event.stats
        assert stats is not None
        drafting = engine.debug.runner.drafting
        return out, {
            "decode_tok_s": stats.decode_tok_s,
            "decode_bytes_per_token": stats.decode_bytes_per_token,
            "slots": engine.debug.ring.num_slots,
            **({"draft": drafting.stats.to_json()} if drafting is not None else {}),
        }


async def main() -> None:
    p = harness.parser(__doc__)
    harness.vault(p)
    p.add_argument("--ring", default="25%", help="the ring: a share of the experts, or a size")
    harness.device(p)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--tasks", default="repeat,free")
    p.add_argument("--modes", default="plain,ngram", help="also: oracle, wrong (docstring)")
    args = p.parse_args()
    vault = Vault.open(args.vault)
    ring = {**ring_options(vault, args.ring), "device": args.device}
    vocab = vault.manifest.shape.vocab_size
    async with Engine.open(args.vault, **ring) as probe:
        tasks = prompts(vault, probe.tokenizer)
        dtype = str(probe.dtype)
    report: dict = {"vault": args.vault, "ring": args.ring, "slots": ring.get("slots")}
    report.update(device=args.device or "default", dtype=dtype)
    report.update(tokens=args.tokens, draft_tokens=args.draft_tokens, tasks={})
    for task in args.tasks.split(","):
        ids = tasks[task]
        modes = args.modes.split(",")
        runs: dict[str, list[dict]] = {mode: [] for mode in modes}
        outputs = set()
        truth: list[int] = []
        for _ in range(args.trials):
            for mode in modes:  # alternating: plain first, whose output the oracle drafts
                drafting = drafting_for(mode, truth, vocab, args.draft_tokens)
                out, row = await one(args.vault, ring, ids, args.tokens, drafting)
                print(task, mode, json.dumps(row), file=sys.stderr, flush=True)  # progress
                if mode == "plain":
                    truth = [*ids, *out]
                outputs.add(tuple(out))
                runs[mode].append(row)
        summary = {}
        for mode, rows in runs.items():
            summary[mode] = {
                "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rows),
                "decode_bytes_per_token": statistics.median(
                    r["decode_bytes_per_token"] for r in rows
                ),
                "trials": rows,
            }
        for mode in modes[1:]:
            summary[f"{mode}_speedup"] = (
                summary[mode]["decode_tok_s"] / summary["plain"]["decode_tok_s"]
            )
        summary["identical_tokens"] = len(outputs) == 1
        summary["prompt_tokens"] = len(ids)
        report["tasks"][task] = summary
    harness.report(report, args)


if __name__ == "__main__":
    smoe.util.loop.run(main())
