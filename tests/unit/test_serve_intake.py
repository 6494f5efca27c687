"""What a request may hold before it is queued (smoe/serve/intake.py, issue 49): the
estimates are upper bounds of what Python really allocates, the pools never go negative
or past their capacity, a body is refused before it is read when it cannot fit, and the
text bound never refuses a prompt whose tokens fit."""

from __future__ import annotations

import json
import random
import tracemalloc
from typing import Any

import anyio
import pytest

from smoe.engine.tokenizer import load_tokenizer
from smoe.serve.api_error import ApiError
from smoe.serve.intake import (
    SMALL_BODY,
    TOKENIZE_BYTES,
    BytePool,
    RequestMemory,
    json_values,
    parse_bytes,
    read_body,
)
from smoe.serve.vocab import NORMALIZER_SLACK, longest_token_bytes, text_limit
from tests.conftest import tiny_vault


def tokenizer(root, seed):
    return load_tokenizer(tiny_vault(root, seed=seed).path, None)


def count_values(x: Any) -> int:
    if isinstance(x, dict):
        return 1 + sum(count_values(v) for v in x.values()) + len(x)  # keys are values too
    if isinstance(x, list):
        return 1 + sum(count_values(v) for v in x)
    return 1


def random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(7 if depth < 4 else 4)
    if kind == 0:
        return rng.randrange(-(10**9), 10**9)
    if kind == 1:
        return "".join(rng.choice('ab"\\,:[]{} é') for _ in range(rng.randrange(6)))
    if kind == 2:
        return rng.choice([None, True, False, 1.5])
    if kind == 3:
        return ""
    if kind in (4, 5):
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {f"k{i}": random_json(rng, depth + 1) for i in range(rng.randrange(4))}


def test_json_values_bounds_what_is_parsed():
    rng = random.Random(49)
    for _ in range(300):
        doc = random_json(rng)
        raw = json.dumps(doc, ensure_ascii=rng.random() < 0.5).encode()
        assert json_values(raw) >= count_values(doc), raw


# The shapes that cost the most per byte once parsed (measured: 24x for empty objects)
SHAPES = {
    "empty objects": b"[" + b",".join([b"{}"] * 200_000) + b"]",
    "empty lists": b"[" + b",".join([b"[]"] * 200_000) + b"]",
    "small objects": b"[" + b",".join([b'{"a":1,"b":[]}'] * 60_000) + b"]",
    "integer ids": b'{"prompt":[' + b",".join([b"151643"] * 100_000) + b"]}",
    "short strings": b"[" + b",".join([b'"ab"'] * 150_000) + b"]",
    "messages": b'{"messages":[' + b",".join([b'{"role":"user","content":"hi"}'] * 30_000) + b"]}",
    "text": b'{"prompt":"' + b"hello world " * 60_000 + b'"}',
}


@pytest.mark.parametrize("shape", SHAPES)
def test_parse_bytes_is_at_least_what_parsing_allocates(shape):
    raw = SHAPES[shape]
    tracemalloc.start()
    try:
        parsed = json.loads(raw.decode())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del parsed
    assert parse_bytes(raw) >= peak + len(raw), (shape, parse_bytes(raw), peak)


def test_tokenize_bytes_is_at_least_what_tokenizing_allocates(tmp_path):
    tok = tokenizer(tmp_path, 3)
    rng = random.Random(5)
    texts = {
        "prose": "The quick brown fox jumps over the lazy dog. " * 3000,
        "cjk": "".join(chr(0x4E00 + rng.randrange(20000)) for _ in range(40_000)),
        "bytes": "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(100_000)),
    }
    for name, text in texts.items():
        tok.encode(text[:100])  # (the tokenizer's own first-call allocations aside)
        tracemalloc.start()
        try:
            ids = tok.encode(text)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert ids
        assert TOKENIZE_BYTES * len(text.encode()) >= peak, (name, peak)


def test_a_pool_never_goes_past_its_capacity_or_below_zero():
    pool = BytePool(100)
    assert pool.try_take(60) and not pool.try_take(41) and pool.try_take(40)
    assert pool.held == 100 and not pool.try_take(1)
    pool.give(100)
    with pytest.raises(RuntimeError):
        pool.give(1)


class FakeContent:
    """A request body arriving in ``chunks``; None: it stalls there."""

    def __init__(self, chunks: list[bytes | None]) -> None:
        self.chunks = chunks

    async def iter_any(self):
        for chunk in self.chunks:
            if chunk is None:
                await anyio.sleep_forever()
            yield chunk


class FakeRequest:
    def __init__(self, chunks: list[bytes | None], length: int | None) -> None:
        self.content = FakeContent(chunks)
        self.content_length = length


async def read(memory: RequestMemory, chunks, length, max_bytes=4 * 2**20, limit_s=30.0):
    return await read_body(FakeRequest(chunks, length), memory, max_bytes, limit_s)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_large_bodies_take_the_receiving_half_and_give_it_back():
    memory = RequestMemory(12 * 2**20)  # 6 MiB for bodies arriving
    small = await read(memory, [b"x" * 1000], 1000)
    assert small.small and memory.receiving.held == 0  # within the connection's allowance
    big = await read(memory, [b"x" * (3 * 2**20)], 3 * 2**20)
    assert memory.receiving.held == 3 * 2**20
    with pytest.raises(ApiError) as e:  # 3 + 3.5 MiB > 6: refused before a byte is read
        await read(memory, [None], 7 * 2**19)
    assert e.value.status == 503 and memory.refused == 1
    with pytest.raises(ApiError) as e:  # past the body limit: 413 at once
        await read(memory, [None], 5 * 2**20)
    assert e.value.status == 413
    big.release()
    big.release()  # (idempotent)
    assert memory.receiving.held == 0
    chunked = await read(memory, [b"x" * SMALL_BODY, b"x" * SMALL_BODY], None)
    assert memory.receiving.held >= 2 * SMALL_BODY  # a chunked body is charged as it grows
    chunked.release()
    with pytest.raises(ApiError) as e:  # chunked past the limit
        await read(memory, [b"x" * SMALL_BODY] * 3, None, max_bytes=2 * SMALL_BODY)
    assert e.value.status == 413 and memory.receiving.held == 0


@pytest.mark.asyncio
async def test_a_stalled_body_times_out_and_gives_its_bytes_back():
    memory = RequestMemory(16 * 2**20)
    with pytest.raises(ApiError) as e:
        await read(memory, [b"x" * 1000, None], 2 * 2**20, limit_s=0.05)
    assert e.value.status == 408 and memory.receiving.held == 0
    with anyio.CancelScope() as scope:  # cancelled (the client gone): given back too
        scope.cancel()
        await read(memory, [None], 2 * 2**20)
    assert memory.receiving.held == 0


def test_preparation_past_its_half_is_413_naming_the_flag():
    memory = RequestMemory(16 * 2**20)
    with pytest.raises(ApiError) as e:
        memory.check_parse(b"[" + b",".join([b"{}"] * 100_000) + b"]")
    assert e.value.status == 413 and "--request-memory" in e.value.message
    memory.check_parse(b'{"prompt": "' + b"x" * 2**20 + b'"}')  # a 1 MiB text parses
    with pytest.raises(ApiError):
        memory.check_tokenize(2**20)  # but tokenizing it would take ~96 MiB
    memory.check_tokenize(64 * 1024)


def test_the_text_bound_never_refuses_a_prompt_that_fits(tmp_path):
    """Every text whose tokens fit a context is within ``text_limit`` of it: random texts of
    ASCII, accents (NFC), CJK, emoji, the template's special tokens and long runs."""
    tok = tokenizer(tmp_path, 4)
    longest = longest_token_bytes(tok)
    assert longest is not None and longest >= 1
    rng = random.Random(7)
    alphabet = ["a", " ", "  ", "\n", "é", "e\u0301", "中", "🙂", "<|im_start|>", "=" * 16]
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 400)))
        tokens = len(tok.encode(text))
        limit = text_limit(tok, tokens)
        assert limit is not None and len(text.encode()) <= limit, text
        # and the bound has no more slack than it says
        assert limit == NORMALIZER_SLACK * (tokens + 1) * longest


def test_the_reserve_docs_plan_md_quotes():
    from smoe.serve.intake import serve_reserve

    assert serve_reserve(128, 64 * 2**20) == int(105.25 * 2**20)  # docs/plan.md
