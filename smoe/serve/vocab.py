"""The most bytes of text one token can stand for, from the tokenizer's vocabulary: a text
of more than ``context * longest`` bytes cannot fit ``context`` tokens, which the server
tells without tokenizing it (smoe/serve/intake.py).
"""

from __future__ import annotations

from typing import Any

# A normalizer may shorten text before it is split (NFC joins a letter and its accent):
# the bound allows the text twice the bytes, so it never refuses a prompt that fits.
NORMALIZER_SLACK = 2


def longest_token_bytes(tok: Any) -> int | None:
    """The longest vocabulary entry's UTF-8 bytes: at least the text bytes any one token
    covers (a byte-level token's characters are one byte of text each, but take up to two
    in UTF-8; a SentencePiece '▁' is one space but three bytes; added tokens such as
    '<|im_start|>' count as written). None where the tokenizer has no vocabulary to read."""
    try:
        vocab = tok.get_vocab()
        return max(len(str(piece).encode("utf-8", "surrogatepass")) for piece in vocab)
    except Exception:  # (a tokenizer of the vault's code: no bound rather than no server)
        return None


def text_limit(tok: Any, context: int) -> int | None:
    """The most bytes of text whose tokens may fit ``context``; None: unknown (no bound)."""
    longest = longest_token_bytes(tok)
    return None if longest is None else NORMALIZER_SLACK * (context + 1) * longest
