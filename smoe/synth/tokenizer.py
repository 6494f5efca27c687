"""A small deterministic byte-level BPE tokenizer with ChatML specials and chat template.

Trained with the `tokenizers` library on built-in text (English prose repeated so its merges come
first, then made-up words to fill any vocabulary size), so it needs no download and the files are
identical on every run. Training takes well under a second.
"""

from __future__ import annotations

import json
import random
import unicodedata
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import numpy as np

# Order fixes the ids: <|endoftext|> = 0, <|im_start|> = 1, <|im_end|> = 2 (see presets.py).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_PROSE = """\
The user asks a question and the assistant answers it. The system prompt sets the tone.
A mixture of experts model sends each token to a few of its many experts, so only a small part of
the model runs for every token. The router scores all experts and keeps the best ones.
When the model is larger than memory, the experts can be read from a fast solid state drive while
the attention layers and the router stay resident. Reading an expert takes time, so a cache keeps
the experts that were used recently, and a scheduler reads the next ones before they are needed.
Hello! How are you today? I am fine, thank you. What would you like to talk about?
Please write a short story about a cat who lives in a library and reads books at night.
Once upon a time there was a small cat. Every night she walked between the shelves, reading the
titles, and every morning the librarian found a new book open on the table.
Can you explain how a transformer works? It turns text into tokens, tokens into vectors, and
mixes the vectors with attention, layer after layer, before it predicts the next token.
The weather is nice: 21 degrees, a light wind from the west, and no rain until Friday.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14 42.
Questions, answers, examples, and explanations; lists, tables, code, and prose.
"""

_SYLLABLES = [
    "ka",
    "to",
    "ri",
    "ne",
    "mo",
    "sa",
    "lu",
    "pe",
    "di",
    "ga",
    "vo",
    "ben",
    "tar",
    "ish",
    "ong",
    "el",
    "qua",
    "zi",
    "fu",
    "ro",
    "an",
    "er",
    "in",
    "on",
    "st",
    "th",
    "ch",
    "sh",
    "pr",
    "tr",
    "al",
    "ol",
    "ul",
    "im",
    "um",
    "ex",
    "re",
    "de",
    "co",
    "ma",
]


def corpus() -> list[str]:
    """Training text: real prose, weighted to train first, then pseudo-words for volume."""
    rng = random.Random(0)  # fixed: the tokenizer does not depend on the weights' seed
    words = [
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))) for _ in range(20000)
    ]
    filler = [" ".join(words[i : i + 16]) for i in range(0, len(words), 16)]
    return _PROSE.splitlines() * 50 + filler


def train(vocab_size: int, texts: Iterable[str] | None = None) -> str:
    """tokenizer.json text for a byte-level BPE with exactly `vocab_size` ids, trained on
    ``texts`` (default: the built-in corpus(); the demo model passes its own text)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus() if texts is None else texts, trainer)
    # Every id the model can emit must decode, so fill any shortfall with reserved tokens.
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens(
            [AddedToken(f"<|reserved_{i}|>", special=True) for i in range(missing)]
        )
    if tok.get_vocab_size() != vocab_size:
        raise AssertionError(f"tokenizer has {tok.get_vocab_size()} ids, wanted {vocab_size}")
    return tok.to_str(pretty=True)


def quiet_tokens(tokenizer_json: str) -> np.ndarray:
    """Bool mask over ids: tokens a chat demo should rarely print.

    Those are byte tokens that are not valid UTF-8 on their own, control characters, and the
    specials except <|im_end|> (ending the turn now and then is fine).
    """
    data = json.loads(tokenizer_json)
    vocab: dict[str, int] = data["model"]["vocab"]
    specials = {t["content"]: t["id"] for t in data["added_tokens"]}
    mask = np.zeros(max([*vocab.values(), *specials.values()]) + 1, dtype=bool)
    decode = _byte_decoder()
    for token, i in vocab.items():
        try:
            text = bytes(decode[c] for c in token).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            mask[i] = True
            continue
        mask[i] = any(unicodedata.category(c).startswith("C") and c not in "\n\t" for c in text)
    for token, i in specials.items():
        mask[i] = token != "<|im_end|>"
    return mask


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted (as ByteLevel uses them)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs = list(bs)
    extra = 0
    for b in range(256):
        if b not in bs:  # whitespace, control and other unprintable bytes move to U+0100...
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def save(directory: Path, tokenizer_json: str, max_length: int) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; return the paths."""
    specials = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    config = {
        # PreTrainedTokenizerFast (TokenizersBackend in transformers 5) loads tokenizer.json as is.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "unk_token": None,
        **specials,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    files = {
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
        "special_tokens_map.json": json.dumps(specials, indent=2) + "\n",
    }
    paths = []
    for name, text in files.items():
        path = directory / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths
