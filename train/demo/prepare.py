"""Turn the verses into a tokenizer and chat-formatted token streams for train.py.

Every 25th chapter (the 13th, 38th, ...) is held out: neither the tokenizer nor the model
sees it, and the perplexity test reads it. The rest becomes short ChatML conversations
(1-3 exchanges) of five kinds, so the model answers whatever the user types with fluent
King James English, and a few requests (a reference, a chapter, a name) with the right
passage. Deterministic: the same verses and seed give the same files.

    python -m train.demo.prepare .train            # after train.demo.corpus .train
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import numpy as np

from smoe.synth.tokenizer import CHAT_TEMPLATE, save
from smoe.synth.tokenizer import train as train_tokenizer

VOCAB = 4096
HELD_OUT_EVERY, HELD_OUT_AT = 25, 12
EPOCHS = 6  # distinct samplings of the conversations, concatenated
GREETINGS = (
    "Hello, who are you?",
    "Hello!",
    "Hi.",
    "Good morning.",
    "Who are you?",
    "What is your name?",
    "Can you help me?",
    "Tell me a story.",
    "Say something.",
    "What is the meaning of life?",
    "How are you?",
    "Teach me something.",
    "What should I do today?",
    "Give me some advice.",
    "I am sad.",
    "Thank you.",
)
TOPIC_TEMPLATES = (
    "Tell me about {w}.",
    "What does the book say of {w}?",
    "Speak to me of {w}.",
    "What of {w}?",
    "Read me something about {w}.",
)
PERSON_TEMPLATES = ("Who was {w}?", "Tell me about {w}.", "What did {w} do?")
_WORD = re.compile(r"[A-Za-z]+")
_COMMON = {
    "that",
    "shall",
    "unto",
    "with",
    "they",
    "them",
    "their",
    "have",
    "which",
    "from",
    "were",
    "this",
    "there",
    "thee",
    "thou",
    "thine",
    "upon",
    "when",
    "then",
    "said",
    "will",
    "also",
    "into",
    "because",
    "after",
    "before",
    "hath",
    "even",
    "what",
    "your",
    "every",
    "these",
    "those",
    "against",
    "therefore",
    "made",
    "came",
    "went",
    "hast",
    "shalt",
    "saith",
    "thereof",
    "among",
    "come",
    "neither",
    "nor",
    "over",
    "whom",
    "whose",
}


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def chapters(verses: list[dict]) -> list[list[dict]]:
    out: list[list[dict]] = []
    for v in verses:
        if not out or (out[-1][0]["book"], out[-1][0]["chapter"]) != (v["book"], v["chapter"]):
            out.append([])
        out[-1].append(v)
    return out


def split(verses: list[dict]) -> tuple[list[list[dict]], list[list[dict]]]:
    """(training chapters, held-out chapters)."""
    train, held = [], []
    for i, ch in enumerate(chapters(verses)):
        (held if i % HELD_OUT_EVERY == HELD_OUT_AT else train).append(ch)
    return train, held


def passage(ch: list[dict], start: int, rng: random.Random) -> str:
    return " ".join(v["text"] for v in ch[start : start + rng.randint(1, 4)])


def exchange(ch: list[dict], rng: random.Random) -> tuple[str, str]:
    """One (user, assistant) pair drawn from chapter ``ch``."""
    i = rng.randrange(len(ch))
    kind = rng.random()
    if kind < 0.45 and i + 1 < len(ch):  # a verse, continued
        return ch[i]["text"], passage(ch, i + 1, rng)
    if kind < 0.65:  # a topic taken from the passage
        words = [w for w in _WORD.findall(ch[i]["text"]) if len(w) > 3 and w.lower() not in _COMMON]
        if words:
            w = rng.choice(words)
            templates = (
                PERSON_TEMPLATES
                if w[0].isupper() and w != ch[i]["text"].split()[0]
                else TOPIC_TEMPLATES
            )
            return rng.choice(templates).format(w=w), passage(ch, i, rng)
    if kind < 0.8:  # a reference
        v = ch[i]
        if rng.random() < 0.5:
            return f"{v['book']} {v['chapter']}:{v['verse']}", v["text"]
        return f"Read me {v['book']} {v['chapter']}.", passage(ch, 0, rng)
    return rng.choice(GREETINGS), passage(ch, 0 if rng.random() < 0.5 else i, rng)


def conversation(train: list[list[dict]], ch: list[dict], rng: random.Random) -> str:
    """ChatML text of 1-3 exchanges, the later ones often from a neighbouring chapter."""
    turns = []
    for _ in range(rng.choice((1, 1, 2, 3))):
        user, reply = exchange(ch, rng)
        turns += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        ch = rng.choice(train) if rng.random() < 0.3 else ch
    return "".join(f"<|im_start|>{t['role']}\n{t['content']}<|im_end|>\n" for t in turns)


def main(work_dir: str, seed: str = "0") -> None:
    from tokenizers import Tokenizer

    work = Path(work_dir)
    train, held = split(load(work / "kjv.jsonl"))
    texts = [v["text"] for ch in train for v in ch]
    tok_dir = work / "tokenizer"
    tok_dir.mkdir(exist_ok=True)
    tokenizer_json = train_tokenizer(VOCAB, texts + list(GREETINGS) * 20)
    save(tok_dir, tokenizer_json, max_length=2048)
    tok = Tokenizer.from_str(tokenizer_json)
    rng = random.Random(int(seed))
    endoftext = tok.token_to_id("<|endoftext|>")
    stream: list[int] = []
    for _ in range(EPOCHS):
        order = list(range(len(train)))
        rng.shuffle(order)
        convs = [
            conversation(train, train[c], rng) for c in order for _ in range(len(train[c]) // 2 + 1)
        ]
        rng.shuffle(convs)
        for enc in tok.encode_batch(convs, add_special_tokens=False):
            stream += enc.ids + [endoftext]
    np.save(work / "train_tokens.npy", np.array(stream, dtype=np.uint16))
    held_text = "\n".join(" ".join(v["text"] for v in ch) for ch in held)
    (work / "held_out.txt").write_text(held_text + "\n", encoding="utf-8")
    held_ids = tok.encode(held_text, add_special_tokens=False).ids
    np.save(work / "held_out_tokens.npy", np.array(held_ids, dtype=np.uint16))
    print(
        json.dumps(
            {
                "train_chapters": len(train),
                "held_out_chapters": len(held),
                "train_tokens": len(stream),
                "held_out_tokens": len(held_ids),
                "tokens_per_epoch": len(stream) // EPOCHS,
                "chat_template": CHAT_TEMPLATE[:20] + "...",
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
