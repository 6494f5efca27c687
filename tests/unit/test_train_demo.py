"""The demo model's training scripts (train/demo/): what they parse, split and build is
what the shipped checkpoint says it was made from."""

from __future__ import annotations

import json
import random

import pytest

from smoe.chat.demo import DEMO_SOURCE
from train.demo import prepare
from train.demo.corpus import parse

BIBLE_OUTPUT = """
Genesis 1

  1 In the beginning God created the heaven and the earth.
  2 And the earth was without form, and void; and darkness was upon the face of
the deep. And the Spirit of God moved upon the face of the waters.

Genesis 2

  1 Thus the heavens and the earth were finished, and all the host of them.
"""


def test_bible_output_parses_into_verses_with_wrapped_lines_joined():
    verses = parse(BIBLE_OUTPUT)
    assert [(v.book, v.chapter, v.verse) for v in verses] == [
        ("Genesis", 1, 1),
        ("Genesis", 1, 2),
        ("Genesis", 2, 1),
    ]
    assert verses[1].text == (
        "And the earth was without form, and void; and darkness was upon the face of "
        "the deep. And the Spirit of God moved upon the face of the waters."
    )
    with pytest.raises(ValueError, match="unexpected line"):
        parse("  stray text before any verse\n")


def fake_verses(chapters: int) -> list[dict]:
    return [
        {"book": "Book", "chapter": c, "verse": v, "text": f"Word{c} and Name{v} came unto them."}
        for c in range(1, chapters + 1)
        for v in range(1, 4)
    ]


def test_every_25th_chapter_is_held_out_from_the_13th():
    train, held = prepare.split(fake_verses(60))
    assert [ch[0]["chapter"] for ch in held] == [13, 38]
    assert len(train) == 58 and all(ch[0]["chapter"] not in (13, 38) for ch in train)


def test_chat_data_is_chatml_and_deterministic():
    train, _ = prepare.split(fake_verses(30))
    one = [prepare.conversation(train, ch, random.Random(5)) for ch in train[:10]]
    two = [prepare.conversation(train, ch, random.Random(5)) for ch in train[:10]]
    assert one == two
    for text in one:
        assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_end|>\n")
        assert text.count("<|im_start|>assistant\n") == text.count("<|im_start|>user\n")


def test_the_shipped_checkpoint_has_the_scripts_geometry_and_tokenizer_size():
    from train.demo.train import GEOMETRY

    shipped = json.loads((DEMO_SOURCE / "config.json").read_text())
    for key, value in GEOMETRY.items():
        if key == "num_experts":
            assert shipped["num_experts"] == value
        elif key != "rope_theta":
            assert shipped[key] == value, key
    assert shipped["rope_theta"] == GEOMETRY["rope_theta"]
    vocab = json.loads((DEMO_SOURCE / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(vocab) == prepare.VOCAB == shipped["vocab_size"]
    training = json.loads((DEMO_SOURCE / "training.json").read_text())
    assert training["parameters"] == 12_570_240 and training["steps"] == 500
