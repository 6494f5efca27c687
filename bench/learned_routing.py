"""Routing archives of a trained model (the built-in demo by default), for the policy and
locality studies (docs/cache-policy.md, docs/speculation.md). Prints JSON; writes two .npz:

- OUT/heldout.npz: teacher-forced routing of held-out text, in windows of --window tokens
  (the training length). Every token becomes its own decode-like request (batch = token,
  phase = decode): routing depends only on the prefix, so this is exactly what decoding
  that text one token at a time routes, without sampling noise.
- OUT/chats.npz: real decode routing (lookahead recorded): --chats conversations, each a
  held-out verse as the user's message and --reply sampled tokens (temperature 0.8).

    python bench/learned_routing.py OUT [--vault V] [--text train-held-out.txt] [--windows 8]
"""

from __future__ import annotations

from pathlib import Path

import harness
import numpy as np

import smoe.util.loop
from smoe.engine import Engine
from smoe.telemetry.archive import DECODE, RoutingArchive

DEFAULT_TEXT = Path(__file__).parent.parent / "tests" / "data" / "kjv_held_out.txt"


def as_decode(archive: RoutingArchive) -> RoutingArchive:
    """Each token its own decode request (see the module docstring)."""
    n = archive.num_tokens
    meta = {**archive.meta, "view": "teacher-forced, one request per token"}
    return RoutingArchive(
        archive.num_experts,
        archive.top_k,
        archive.layers,
        archive.ranks,
        np.arange(n, dtype=np.int32),
        np.full(n, DECODE, np.uint8),
        meta,
        archive.ahead,
    )


async def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("--vault", default=None)
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--chats", type=int, default=4)
    ap.add_argument("--reply", type=int, default=256)
    args = ap.parse_args()
    vault = args.vault
    if vault is None:
        from smoe.chat.demo import demo_vault

        vault = str(demo_vault())
    args.out.mkdir(parents=True, exist_ok=True)
    text = args.text.read_text(encoding="utf-8")
    report: dict = {"vault": vault, "text": str(args.text)}
    async with Engine.open(vault) as engine:
        experts = engine.vault.manifest.num_experts
        ids = engine.encode(text)
        windows = [ids[i : i + args.window] for i in range(0, len(ids), args.window)]
        windows = [w for w in windows if len(w) == args.window][: args.windows]
        engine.learning.start_recording(depth=experts)
        for w in windows:
            await engine.logits(w)
        held = as_decode(engine.learning.stop_recording())
        held.meta["source"] = "kjv-demo held-out text"
        report["heldout"] = {
            "path": str(held.save(args.out / "heldout.npz")),
            "tokens": held.num_tokens,
        }
        verses = [line for line in text.split(". ") if 40 < len(line) < 200][: args.chats]
        engine.learning.start_recording(depth=experts)
        for i, verse in enumerate(verses):
            prompt = engine.conversation().template([{"role": "user", "content": verse + "."}])
            events = engine.generate(
                prompt,
                max_tokens=args.reply,
                temperature=0.8,
                top_p=0.95,
                seed=i,
                stop_at_eos=False,  # the same number of decode tokens per chat
            )
            async for _ in events:
                pass
        chats = engine.learning.stop_recording()
        chats.meta["source"] = f"kjv-demo {len(verses)} chats x {args.reply} sampled tokens"
        report["chats"] = {
            "path": str(chats.save(args.out / "chats.npz")),
            "tokens": chats.num_tokens,
            "lookahead_recall": engine.debug.tracer.lookahead_recall,
        }
    harness.report(report, args)


if __name__ == "__main__":
    smoe.util.loop.run(main())
