"""A saved conversation is untrusted input (issue 30): every crafted file, a field missing,
not JSON, of the wrong type or out of range, a flipped byte in its KV cache or its history,
is one SmoeError naming the file, and the conversation that was loaded before stays."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from smoe.engine import Engine
from smoe.engine.conversation import Conversation
from smoe.engine.conversation_file import FORMAT_1
from smoe.errors import SmoeError
from tests.conftest import tiny_vault

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    return tiny_vault(tmp_path_factory.mktemp("convfile"), seed=8)


def _read(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path: Path, header: dict, data: bytes) -> Path:
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)
    return path


def _meta_edit(key: str, value: str | None):
    """Our field ``key`` (mlx-lm keeps the caller's metadata under "0.")."""

    def edit(header: dict, data: bytes) -> tuple[dict, bytes]:
        meta = header["__metadata__"]
        if value is None:
            meta.pop(f"0.{key}")
        else:
            meta[f"0.{key}"] = value
        return header, data

    return edit


def _flip_kv(header: dict, data: bytes) -> tuple[dict, bytes]:
    b = bytearray(data)
    b[len(b) // 2] ^= 0x10
    return header, bytes(b)


CASES = {
    **{
        f"no {k}": _meta_edit(k, None) for k in ("system", "messages", "tokens", "cached", "digest")
    },
    "messages not JSON": _meta_edit("messages", "[{"),
    "messages a number": _meta_edit("messages", "7"),
    "a message without content": _meta_edit("messages", '[{"role": "user"}]'),
    "a message of numbers": _meta_edit("messages", '[{"role": 1, "content": 2}]'),
    "system a list": _meta_edit("system", "[1]"),
    "tokens not JSON": _meta_edit("tokens", "nope"),
    "tokens a dict": _meta_edit("tokens", '{"a": 1}'),
    "a negative token": _meta_edit("tokens", "[1, -5]"),
    "a token past the vocabulary": _meta_edit("tokens", "[1, 99999999]"),
    "a float token": _meta_edit("tokens", "[1.5]"),
    "cached huge": _meta_edit("cached", "99999999"),
    "cached negative": _meta_edit("cached", "-3"),
    "cached not a number": _meta_edit("cached", "many"),
    "reply_end a string": _meta_edit("reply_end", '"x"'),
    "reply_end huge": _meta_edit("reply_end", "10000000"),
    "kv_bits not JSON": _meta_edit("kv_bits", "{"),
    "digest changed": _meta_edit("digest", "0" * 32),
    "a flipped byte in the KV cache": _flip_kv,
}


async def test_every_crafted_file_is_one_error_and_the_chat_stays(vault, tmp_path):
    async with Engine.open(vault.path) as engine:
        conv = engine.conversation()
        [e async for e in conv.send("hello there", max_tokens=4)]
        good = await conv.save(tmp_path / "good.safetensors")
        again = await Conversation.load(engine, good)  # the untouched file loads
        assert again.tokens == conv.tokens and again.messages == conv.messages
        header, data = _read(good)
        refused = {}
        for name, edit in CASES.items():
            h, d = edit(json.loads(json.dumps(header)), data)
            bad = _write(tmp_path / f"{len(refused)}.safetensors", h, d)
            with pytest.raises(SmoeError) as e:
                await Conversation.load(engine, bad)
            refused[name] = str(e.value)
        for name, message in refused.items():
            assert "\n" not in message and str(tmp_path) in message, (name, message)
        # the engine still serves the conversation it had
        assert [e async for e in conv.send("and then?", max_tokens=2)]


async def test_a_file_of_the_first_format_loads_with_its_fields_checked(vault, tmp_path):
    """Files saved before the digest (format 1) still load; their fields are checked."""
    async with Engine.open(vault.path) as engine:
        conv = engine.conversation()
        [e async for e in conv.send("hello", max_tokens=3)]
        header, data = _read(await conv.save(tmp_path / "c.safetensors"))
        meta = header["__metadata__"]
        meta["0.format"] = FORMAT_1
        meta.pop("0.digest")
        old = _write(tmp_path / "old.safetensors", header, data)
        assert (await Conversation.load(engine, old)).tokens == conv.tokens
        meta["0.cached"] = "-1"
        with pytest.raises(SmoeError, match="'cached'"):
            await Conversation.load(engine, _write(tmp_path / "bad.safetensors", header, data))


async def test_a_name_the_os_cannot_take_is_one_error(vault, tmp_path):
    """/save with a NUL byte in the name was a ValueError traceback."""
    async with Engine.open(vault.path) as engine:
        with pytest.raises(SmoeError, match="cannot save"):
            await engine.conversation().save(tmp_path / "a\0b")
