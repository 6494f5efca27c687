"""A saved conversation is untrusted input (issue 30): every crafted file, a field missing,
not JSON, of the wrong type or out of range, a flipped byte in its KV cache or its history,
is one SmoeError naming the file, and the conversation that was loaded before stays."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def _write(path: Path, header: dict | bytes, data: bytes) -> Path:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
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


# ---------------------------------------------------------------- issue 49: the header first
_ITEM = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "I64": 8}


def _resign(header: dict, good: Path) -> dict:
    """``header`` with its digest made again over its (edited) fields and ``good``'s KV
    arrays: what someone crafting a file would do, so the digest lets it through."""
    from mlx_lm.models.cache import load_prompt_cache

    from smoe.engine.conversation_file import cache_arrays, conversation_digest

    meta = header["__metadata__"]
    ours = {k[2:]: v for k, v in meta.items() if k.startswith("0.")}
    meta["0.digest"] = conversation_digest(ours, cache_arrays(load_prompt_cache(str(good))))
    return header


def _sparse(good: Path, out: Path, tokens: int) -> Path:
    """``good`` with every KV array declared ``tokens`` long: the kept numbers first, then
    the arrays, which the file leaves as a hole (a few KB on disk, gigabytes declared)."""
    header, data = _read(good)
    new, kept, arrays = {"__metadata__": header["__metadata__"]}, bytearray(), []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if len(entry["shape"]) != 4:
            begin, end = entry["data_offsets"]
            new[name] = {**entry, "data_offsets": [len(kept), len(kept) + end - begin]}
            kept += data[begin:end]
        else:
            arrays.append((name, entry))
    end = len(kept)
    for name, entry in arrays:
        shape = [*entry["shape"][:2], tokens, entry["shape"][3]]
        size = math.prod(shape) * _ITEM[entry["dtype"]]
        new[name] = {**entry, "shape": shape, "data_offsets": [end, end + size]}
        end += size
    _write(out, new, bytes(kept))
    os.truncate(out, out.stat().st_size - len(kept) + end)
    return out


_MEMORY = """
import asyncio, json, resource, sys
from smoe.engine import Engine
from smoe.engine.conversation import Conversation
from smoe.errors import SmoeError

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

async def main(vault, good, bad):
    async with Engine.open(vault) as engine:
        await Conversation.load(engine, good)
        loaded = peak()
        try:
            await Conversation.load(engine, bad)
            error = None
        except SmoeError as e:
            error = str(e)
        print(json.dumps({"good": loaded, "bad": peak(), "error": error}))

asyncio.run(main(*sys.argv[1:]))
"""


def _measure(cmd: list[str]) -> tuple[Any, subprocess.CompletedProcess[str]]:
    from tests.cgroup import limited

    run = limited(cmd, 700 * 2**20, capture_output=True, text=True, timeout=300)
    if run is not None:
        return run, run.result
    return None, subprocess.run(cmd, capture_output=True, text=True, timeout=300)


async def test_a_sparse_file_declaring_huge_arrays_is_refused_before_any_is_read(vault, tmp_path):
    """/load of a 4 KB sparse file declaring [1, 2, 10**6, 16] float32 KV arrays (768 MB)
    took `smoe chat` from 0.28 to 1.18 GB before the digest refused it (on a 700 MB budget,
    an OOM kill): now its header is refused against the model's context first, and the
    peak memory is that of loading a valid file. In a 700 MB memory group where there is
    one (tests/cgroup.py), as the issue's budget."""
    async with Engine.open(vault.path) as engine:
        conv = engine.conversation()
        [e async for e in conv.send("hello there", max_tokens=4)]
        good = await conv.save(tmp_path / "good.safetensors")
    bad = _sparse(good, tmp_path / "sparse.safetensors", 10**6)
    assert bad.stat().st_size > 700 * 2**20 and bad.stat().st_blocks * 512 < 2**20
    cmd = [sys.executable, "-c", _MEMORY, str(vault.path), str(good), str(bad)]
    run, result = await asyncio.to_thread(_measure, cmd)
    assert result.returncode == 0 and (run is None or run.oom_kills == 0), result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["error"] and "\n" not in out["error"] and str(bad) in out["error"]
    assert "1000000 tokens" in out["error"] and "context" in out["error"]
    assert out["bad"] <= 1.1 * out["good"], out


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def _fields(**fields: str):
    """Fields of the good file replaced, the digest made again (``_resign``)."""

    def edit(header: dict, good: Path) -> dict:
        header["__metadata__"].update({f"0.{k}": v for k, v in fields.items()})
        return _resign(header, good)

    return edit


def _header(change):
    def edit(header: dict, good: Path) -> dict:
        change(header)
        return header

    return edit


def _set(where: str, key: str, value):
    def change(header: dict) -> None:
        (header["__metadata__"] if where == "meta" else header[where])[key] = value

    return change


def _numbered(header: dict) -> None:
    meta = header["__metadata__"]
    for key in [k for k in meta if k.startswith("0.")]:
        del meta[key]
    meta["0.0"] = "x"


def _many_tokens(header: dict, good: Path) -> dict:  # a stream past the context, re-signed
    tokens = json.loads(header["__metadata__"]["0.tokens"])
    return _fields(tokens=json.dumps(tokens + [5] * 5000))(header, good)


RESIGNED = {  # each re-signed: the digest passes, the field itself must be refused
    "messages 100,000 deep": _fields(messages=_deep(100_000)),
    "tokens 100,000 deep": _fields(tokens=_deep(100_000)),
    "system 100,000 deep": _fields(system=_deep(100_000)),
    "reply_end 100,000 deep": _fields(reply_end=_deep(100_000)),
    "kv_bits 100,000 deep": _fields(kv_bits=_deep(100_000)),
    "messages nested 3 deep": _fields(messages='[[{"role": "user", "content": "x"}]]'),
    "tokens past the context": _many_tokens,
    "more messages than the context has tokens": _fields(
        messages=json.dumps([{"role": "user", "content": ""}] * 5000)
    ),
}
HEADERS = {  # the header itself: refused before any array is read
    "fields named by numbers (a list to mlx-lm)": _header(_numbered),
    "metadata with a stray entry": _header(_set("meta", "9.9", "x")),
    "a layer of another cache kind": _header(_set("meta", "1.0", "RotatingKVCache")),
    "a layer naming a module global": _header(_set("meta", "1.0", "mx")),
    "a kept offset as a float": _header(
        lambda h: h["0.2"].update(dtype="F32")  # (4 bytes either way)
    ),
    "keys of other heads": _header(lambda h: h["0.0"].update(shape=[1, 4, 128, 16])),
    "keys in float16": _header(
        lambda h: h["0.0"].update(dtype="F16", shape=[1, 2, 512, 16])  # same bytes
    ),
    "an array past the layers": _header(lambda h: h.update({"7.0": h.pop("0.0")})),
    "an array past the file's end": _header(
        lambda h: h["0.0"].update(data_offsets=[10**9, 10**9 + 32768])
    ),
    "a header 100,000 deep": lambda h, good: (
        json.dumps(h)[:-1].encode() + b', "x": ' + _deep(100_000).encode() + b"}"
    ),
    "a header of 6 MiB (a context of 4096 allows 5)": lambda h, good: (
        json.dumps(h).encode() + b" " * 6 * 2**20
    ),
}
TRUNCATED = {  # the good file cut short: its arrays, or its header, past its end
    "arrays cut off": lambda raw: raw[: len(raw) // 2],
    "a header length past the end": lambda raw: (10**12).to_bytes(8, "little") + raw[8:],
    "8 bytes": lambda raw: raw[:8],
}


async def test_crafted_headers_and_resigned_fields_are_one_error_and_the_chat_stays(
    vault, tmp_path
):
    """Issue 49: a 100,000-deep history was a RecursionError that ended `smoe chat`; a
    re-signed stream past the context loaded; a header's numbered field, stray entry,
    cache kind or kept number reached mlx-lm's loader unchecked."""
    async with Engine.open(vault.path) as engine:
        conv = engine.conversation()
        [e async for e in conv.send("hello there", max_tokens=4)]
        good = await conv.save(tmp_path / "good.safetensors")
        header, data = _read(good)
        refused = {}
        for name, edit in {**RESIGNED, **HEADERS, **TRUNCATED}.items():
            bad = tmp_path / f"{len(refused)}.safetensors"
            if name in TRUNCATED:
                bad.write_bytes(TRUNCATED[name](good.read_bytes()))
            else:
                _write(bad, edit(json.loads(json.dumps(header)), good), data)
            try:
                await Conversation.load(engine, bad)
                refused[name] = "loaded"
            except SmoeError as e:
                refused[name] = str(e)
            except BaseException as e:  # what ended the REPL
                refused[name] = f"{type(e).__name__} escaped"
        wrong = {
            name: m
            for name, m in refused.items()
            if "\n" in m or str(tmp_path) not in m or "escaped" in m
        }
        assert not wrong, wrong
        assert [e async for e in conv.send("and then?", max_tokens=2)]


async def test_a_failed_load_never_ends_the_chat(vault, tmp_path, monkeypatch):
    """/load of a file whose history nests 100,000 deep ended `smoe chat` (a RecursionError
    traceback) and the conversation in progress with it. Any failure of /load, even one
    not foreseen (a bug), is one line; the chat goes on with its conversation."""
    from smoe.chat.repl import ChatApp

    out = io.StringIO()
    async with Engine.open(vault.path) as engine:
        app = ChatApp(engine, engine.conversation(), out=out, sampling={"max_tokens": 4})
        await app.reply("hello there")
        before, good = app.conv, tmp_path / "good.safetensors"
        assert await app.command(f"/save {good}")
        header, data = _read(good)
        deep = _fields(messages=_deep(100_000))(header, good)
        assert await app.command(f"/load {_write(tmp_path / 'deep.safetensors', deep, data)}")

        async def unforeseen(engine, path):
            raise RuntimeError("a bug\nover two lines")

        monkeypatch.setattr(Conversation, "load", unforeseen)
        assert await app.command(f"/load {good}")
        errors = [line for line in out.getvalue().splitlines() if line.startswith("error:")]
        assert len(errors) == 2 and "'messages'" in errors[0] and "RuntimeError" in errors[1]
        assert app.conv is before
        await app.reply("and then?")
    assert "error" not in out.getvalue().splitlines()[-1]


async def test_a_turn_cancelled_in_its_prefill_saves_a_file_that_loads(vault, tmp_path):
    """Saved after a turn was cancelled in the middle of its layer-major prefill, the file
    held layers out of step ("its KV cache holds [136] tokens, not the 24 it says"): the
    conversation could never be loaded. Its layers now go back to the tokens cached before
    that turn, and the loaded conversation goes on from them."""
    async with Engine.open(vault.path, prefill_chunk=16) as engine:
        conv = engine.conversation()
        [e async for e in conv.send("hello there", max_tokens=4)]

        async def turn() -> None:
            async for _ in conv.send("word " * 500, max_tokens=2):
                pass

        task = asyncio.create_task(turn())
        for _ in range(100_000):  # until the prefill is under way, suspended between layers
            await asyncio.sleep(0)
            if conv._seq is not None and conv._seq.prompt is not None:
                break
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert conv._seq.prompt is not None and conv._seq.cached > 0
        cached = conv._seq.cached
        path = await conv.save(tmp_path / "cut.safetensors")
        loaded = await Conversation.load(engine, path)
        assert loaded.messages == conv.messages and loaded.tokens == conv.tokens
        assert loaded._seq.cached == cached
        assert [e async for e in loaded.send("go on", max_tokens=2)]
