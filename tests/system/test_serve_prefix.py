"""`smoe serve` continues a reply its client sends back from the ids it generated
(``PrefixCache.follow_up``, ``smoe.engine.conversation.follow_up_prompt``): only the new turn is
prefilled. A reply the client changed, or one cut inside a token by a stop string (its
text is not what any of its ids decode to), is never taken for ours."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import jinja2
import pytest

from smoe.compute.sequence import Sequence_
from smoe.engine import Engine
from smoe.engine.conversation import REPLY_MARK, follow_up_prompt
from smoe.sampling import SamplingParams
from smoe.serve.app import Server, ServerOptions
from smoe.serve.prefix import ChatReply, PrefixCache
from smoe.util.tokens import common_prefix
from tests import serving
from tests.conftest import tiny_vault

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-prefix")
    return tiny_vault(root, seed=11)


class Running(serving.Running):
    """A server on ``engine`` whose ``Server`` the test can look into. ``reuse=False``:
    the reference, which keeps its sequences (to be looked at) but never reuses one."""

    def __init__(self, engine: Engine, options: ServerOptions, reuse: bool = True) -> None:
        super().__init__(engine, options, Server(engine, options))
        if not reuse:
            self.server.cache.take = lambda prompt: (None, 0)  # type: ignore[method-assign]

    async def __aenter__(self) -> Running:
        await super().__aenter__()
        self.openai = self.client(key="-")
        return self

    async def stats(self) -> dict[str, Any]:
        async with aiohttp.ClientSession() as http, http.get(self.base + "/v1/smoe/stats") as r:
            return await r.json()  # type: ignore[no-any-return]

    def last(self) -> Any:
        """The prefix cache's newest entry: the last request's sequence (and reply)."""
        return self.server.cache.entries[0]


@contextlib.asynccontextmanager
async def pair(vault: Any, monkeypatch: Any) -> AsyncIterator[tuple[Any, Running, Running]]:
    """(tokenizer, server, reference) on one engine, the tokenizer made byte-level so that
    a reply's text never tokenizes back to the ids generated."""
    async with Engine.open(vault.path) as engine:
        byte_level(engine.tokenizer, monkeypatch)
        async with (
            Running(engine, ServerOptions()) as srv,
            Running(engine, ServerOptions(), reuse=False) as ref,
        ):
            yield engine.tokenizer, srv, ref


@dataclass
class Reply:
    text: str
    finish: str
    usage: dict[str, Any]


async def chat(srv: Running, messages: list[dict[str, str]], stream: bool, **kw: Any) -> Reply:
    kw = {"max_tokens": 12, "temperature": 0, **kw}
    c = srv.openai.chat.completions
    if not stream:
        r = await c.create(model="smoe", messages=messages, **kw)
        choice = r.choices[0]
        return Reply(choice.message.content or "", choice.finish_reason, r.usage.model_dump())
    pieces, finish, usage = [], "", {}
    async for chunk in await c.create(model="smoe", messages=messages, stream=True, **kw):
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return Reply("".join(pieces), finish, usage)


async def complete(srv: Running, ids: list[int], **kw: Any) -> Reply:
    kw = {"max_tokens": 12, "temperature": 0, **kw}
    r = await srv.openai.completions.create(model="smoe", prompt=ids, **kw)
    return Reply(r.choices[0].text, r.choices[0].finish_reason, r.usage.model_dump())


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the token each byte is when nothing merges."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += range(ord("®"), ord("ÿ") + 1)
    cs = list(bs)
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)  # 188 printable bytes map to themselves
    return dict(zip(bs, map(chr, cs), strict=True))


def byte_level(tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``tok`` tokenize text one byte per id (special tokens stay whole): the model
    generates merged tokens, so the text of a reply tokenized again always gets other ids
    than the ones generated. The detokenizer is unchanged.

    The patches go on the wrapped transformers tokenizer, a plain object that mlx-lm's
    ``TokenizerWrapper`` forwards ``encode`` and ``apply_chat_template`` to: the wrapper's
    own ``__setattr__`` forwards too, so monkeypatch could not undo a patch made on it."""
    hf = tok._tokenizer
    specials = {
        t: hf.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    }
    alphabet = bytes_to_unicode()
    split = re.compile("(" + "|".join(map(re.escape, specials)) + ")")

    def encode(text: str, add_special_tokens: bool = False, **kw: Any) -> list[int]:
        ids: list[int] = []
        for part in split.split(text):
            if part in specials:
                ids.append(specials[part])
            else:
                ids.extend(hf.convert_tokens_to_ids(alphabet[b]) for b in part.encode())
        return ids

    template = hf.apply_chat_template

    def apply_chat_template(messages: Any, *a: Any, tokenize: bool = True, **kw: Any) -> Any:
        text = template(messages, *a, tokenize=False, **kw)
        return encode(text) if tokenize else text

    monkeypatch.setattr(hf, "encode", encode)
    monkeypatch.setattr(hf, "apply_chat_template", apply_chat_template)
    assert tok.encode("ab") == encode("ab"), "the wrapper no longer forwards encode"
    assert hf.convert_tokens_to_ids("Hello") != encode("Hello")[0]  # merged vs bytes


def new_turn(
    tok: Any, history: list[dict[str, str]], new: list[dict[str, str]], ended: bool
) -> list[int]:
    """The template's tokens after an assistant reply to ``history`` (minus the end of turn
    that ends the stream when the model ended its turn), worked out here independently."""
    marked = [*history, {"role": "assistant", "content": "\ue000"}, *new]
    text = tok.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
    tail = text.split("\ue000")[1]
    if ended:
        tail = tail.removeprefix("<|im_end|>")
    return list(tok.encode(tail, add_special_tokens=False))


def stream_of(srv: Running, reply: Reply, n: int | None = None) -> list[int]:
    """The last request's prompt and its first ``n`` generated ids (all of them, and the
    end-of-turn id if the model ended its turn, when ``n`` is None)."""
    prompt = reply.usage["prompt_tokens"]
    if n is None:
        n = reply.usage["completion_tokens"] + (reply.finish == "stop")
    tokens = srv.last().seq.tokens
    return list(tokens[: prompt + n])


def templated(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


USER = [{"role": "user", "content": "Hello"}]  # its greedy reply starts without a space


# ------------------------------------------------------------------ (a) the new turn only


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streaming"])
async def test_a_reply_sent_back_prefills_only_the_new_turn(vault, monkeypatch, stream):
    """The tokenizer gives the reply's text other ids than the generated ones, so templating
    the follow-up whole would prefill the reply again. The server continues from the
    generated ids: the follow-up prefills exactly the new turn's tokens (template tokens
    included), twice in a row, and its output is the model's for those ids, token for
    token (a server that reuses nothing, given the ids)."""
    async with pair(vault, monkeypatch) as (tok, srv, ref):
        messages = list(USER)
        reply = await chat(srv, messages, stream)
        for turn, question in enumerate(["More.", "Why?"]):
            assert srv.last().reply is not None, "the premise: the reply is kept as ours"
            ours = stream_of(srv, reply)
            generated = ours[reply.usage["prompt_tokens"] :]
            assert tok.encode(reply.text) != generated[: reply.usage["completion_tokens"]]
            follow = [
                *messages,
                {"role": "assistant", "content": reply.text},
                {"role": "user", "content": question},
            ]
            # templated whole, the prompt would part from the stream inside the reply
            assert common_prefix(templated(tok, follow), ours) < len(ours) - 1
            new = new_turn(tok, messages, follow[-1:], ended=reply.finish == "stop")
            before = await srv.stats()
            got = await chat(srv, follow, stream, temperature=0.8, seed=3 + turn)
            after = await srv.stats()
            assert got.usage["prompt_tokens"] == len(ours) + len(new)
            assert after["prefilled_tokens"] - before["prefilled_tokens"] == len(new)
            assert got.usage["prompt_tokens_details"]["cached_tokens"] == len(ours) - 1
            assert after["prefix_cache"]["reply_follow_ups"] == turn + 1
            prompt = [*ours, *new]
            assert stream_of(srv, got)[: len(prompt)] == prompt
            want = await complete(ref, prompt, temperature=0.8, seed=3 + turn)
            assert (got.text, got.finish) == (want.text, want.finish)
            assert stream_of(srv, got) == stream_of(ref, want)  # the same ids
            messages, reply = follow, got
        assert (await ref.stats())["prefix_reused_tokens"] == 0


async def test_a_reply_the_model_ended_is_continued_without_its_end(vault, monkeypatch):
    """The model ends its turn (here with an id made an end of turn for the test, whose
    text the template does not write): the reply's ids are continued, then the template's
    own end of turn; the new turn alone is prefilled, and the output is the model's."""
    async with pair(vault, monkeypatch) as (tok, srv, ref):
        full = await chat(srv, USER, False)
        n = full.usage["completion_tokens"]
        generated = stream_of(srv, full, n)[-n:]
        end = next(j for j in range(2, n) if generated[j] not in generated[:j])
        monkeypatch.setattr(tok, "eos_token_ids", {*tok.eos_token_ids, generated[end]})
        first = await chat(srv, USER, False)
        assert (first.finish, first.usage["completion_tokens"]) == ("stop", end)
        assert first.text == tok.decode(generated[:end])
        kept = srv.last().reply
        prompt = first.usage["prompt_tokens"]
        assert kept is not None and kept.end == prompt + end + 1  # the end id is in it
        ours = stream_of(srv, first, end)
        follow = [*USER, {"role": "assistant", "content": first.text}, *USER]
        new = new_turn(tok, USER, USER, ended=False)  # the template's end of turn
        got = await chat(srv, follow, False)
        assert got.usage["prompt_tokens"] == len(ours) + len(new)
        assert got.usage["prompt_tokens_details"]["cached_tokens"] == len(ours)
        want = await complete(ref, [*ours, *new])
        assert (got.text, got.finish) == (want.text, want.finish)


async def test_what_is_kept_of_a_reply(vault):
    """``kept_reply``: the ids of the text the client got, the end-of-turn id when the
    model ended the turn; nothing where the stream does not hold those ids."""
    from smoe.serve.prefix import kept_reply

    async with Engine.open(vault.path) as engine:
        tok = engine.tokenizer
        messages = list(USER)
        ids = [1, 5, 6, 7]
        gen = list(tok.encode("Hello there", add_special_tokens=False))
        text = tok.decode(gen)
        eos = min(tok.eos_token_ids)

        def kept(tokens, generated=gen, text=text, ended=False, cut=False):
            seq = Sequence_(cache=[], tokens=list(tokens))
            r = kept_reply(tok, messages, ids, seq, generated, text, ended, cut)
            return None if r is None else (r.end, r.text, r.messages)

        assert kept([*ids, *gen]) == (len(ids) + len(gen), text, USER)
        assert kept([*ids, *gen, eos], ended=True) == (len(ids) + len(gen) + 1, text, USER)
        assert kept([*ids, *gen, 9], ended=True) is None  # no end-of-turn id there
        assert kept([*ids, *gen, 9]) == (len(ids) + len(gen), text, USER)
        assert kept([*ids, *gen[:-1]]) is None  # the stream lacks the reply's last id
        assert kept([9, *ids[1:], *gen]) is None  # another prompt
        assert kept([*ids, *gen], text=text + " ") is None  # not the ids' text
        assert kept([*ids, *gen, eos], generated=[*gen, eos], text=text) is None  # ignore_eos
        short = tok.decode(gen[:1])
        assert kept([*ids, *gen, eos], text=short, ended=True, cut=True) == (
            len(ids) + 1,
            short,
            USER,
        )
        k = next(k for k in range(len(gen)) if len(tok.decode(gen[k : k + 1])) > 1)
        inside = text[: len(tok.decode(gen[:k])) + 1]
        assert kept([*ids, *gen], text=inside, cut=True) is None  # cut inside a token


# ------------------------------------------------------------------ (b) no false reuse

ALTERED = {
    "a space added": lambda t: t + " ",
    "the last character dropped": lambda t: t[:-1],
    "a letter changed": lambda t: t[:3] + ("x" if t[3] != "x" else "y") + t[4:],
    "empty": lambda t: "",
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streaming"])
async def test_a_reply_the_client_changed_is_not_taken_for_ours(vault, monkeypatch, stream):
    """Sent back changed in any way, or after other messages, the reply is not ours: the
    messages are templated whole (the prompt shares the ids up to the change at most), and
    the output is that of a server with no prefix cache. The unchanged reply is continued
    (the control: the counter and the prompt tell the two apart)."""
    async with Engine.open(vault.path) as engine:
        tok = engine.tokenizer
        byte_level(tok, monkeypatch)  # a false claim would change the prompt's ids
        async with (
            Running(engine, ServerOptions()) as srv,
            Running(engine, ServerOptions(), reuse=False) as ref,
        ):
            cases = {name: (USER, change) for name, change in ALTERED.items()}
            cases["other messages before it"] = (
                [{"role": "user", "content": "Hello!"}],
                lambda t: t,
            )
            cases["a system message before it"] = (
                [{"role": "system", "content": "S"}, *USER],
                lambda t: t,
            )
            for name, (history, change) in cases.items():
                first = await chat(srv, USER, stream)  # the cache holds this reply anew
                assert srv.last().reply is not None
                assert change(first.text) != first.text or history != USER, name
                follow = [
                    *history,
                    {"role": "assistant", "content": change(first.text)},
                    {"role": "user", "content": "And then?"},
                ]
                got = await chat(srv, follow, stream)
                want = await chat(ref, follow, False)
                assert got.usage["prompt_tokens"] == len(templated(tok, follow)), name
                assert (got.text, got.finish, got.usage["completion_tokens"]) == (
                    want.text,
                    want.finish,
                    want.usage["completion_tokens"],
                ), name
            assert (await srv.stats())["prefix_cache"]["reply_follow_ups"] == 0
            first = await chat(srv, USER, stream)  # the control: sent back as it was
            follow = [*USER, {"role": "assistant", "content": first.text}, *USER]
            got = await chat(srv, follow, stream)
            assert got.usage["prompt_tokens"] != len(templated(tok, follow))
            assert (await srv.stats())["prefix_cache"]["reply_follow_ups"] == 1


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streaming"])
async def test_a_reply_starting_with_a_space_is_kept_with_its_space(vault, monkeypatch, stream):
    """A reply whose first token starts with a space: the client gets its ids' whole text,
    space included (issue 51: mlx-lm's detokenizer dropped it, and no reply was kept).
    Sent back verbatim it is continued from its ids; without its space it is not ours,
    and the messages are templated whole."""
    async with pair(vault, monkeypatch) as (tok, srv, ref):
        history = [{"role": "user", "content": "No"}]
        for sent, ours in ((lambda t: t[1:], False), (lambda t: t, True)):
            first = await chat(srv, history, stream)
            n = first.usage["completion_tokens"]
            decoded = tok.decode(stream_of(srv, first, n)[-n:])
            assert decoded == first.text and first.text.startswith(" ")
            assert srv.last().reply is not None
            follow = [
                *history,
                {"role": "assistant", "content": sent(first.text)},
                {"role": "user", "content": "And then?"},
            ]
            got = await chat(srv, follow, stream)
            whole = len(templated(tok, follow))
            assert (got.usage["prompt_tokens"] == whole) is not ours
            if not ours:
                want = await chat(ref, follow, False)
                assert (got.text, got.finish) == (want.text, want.finish)
        assert (await srv.stats())["prefix_cache"]["reply_follow_ups"] == 1


# ------------------------------------------------------------------ (c) stop strings


def boundaries(tok: Any, ids: list[int]) -> list[int]:
    """Where in the text of ``ids`` each of their prefixes ends."""
    return [len(tok.decode(ids[:n])) for n in range(len(ids) + 1)]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streaming"])
async def test_a_reply_cut_by_a_stop_string(vault, monkeypatch, stream):
    """A stop string that cuts the reply where a token begins: the reply is the ids before
    it (no end of turn), and the follow-up continues from them, prefilling the new turn
    only (the reply's ids were all run), with the model's output for those ids. One that
    cuts inside a token: the text is no ids' text, nothing is kept, the follow-up is
    templated whole."""
    async with pair(vault, monkeypatch) as (tok, srv, ref):
        full = await chat(srv, USER, stream, max_tokens=16)
        n = full.usage["completion_tokens"]
        generated = stream_of(srv, full, n)[-n:]
        text = tok.decode(generated)
        assert text == full.text
        ends = boundaries(tok, generated)
        # a stop string at a token's start: that token's text, first found there
        j = next(
            j
            for j in range(2, n)
            if (piece := tok.decode(generated[j : j + 1])).strip() and text.find(piece) == ends[j]
        )
        stop = tok.decode(generated[j : j + 1])
        cut = await chat(srv, USER, stream, max_tokens=16, stop=[stop])
        assert (cut.text, cut.finish) == (text[: ends[j]], "stop")
        kept = srv.last().reply
        assert kept is not None and kept.end == cut.usage["prompt_tokens"] + j
        ours = stream_of(srv, cut, j)
        follow = [*USER, {"role": "assistant", "content": cut.text}, *USER]
        new = new_turn(tok, USER, USER, ended=False)
        assert new[0] == tok._tokenizer.convert_tokens_to_ids("<|im_end|>")
        before = await srv.stats()
        got = await chat(srv, follow, stream)
        after = await srv.stats()
        assert got.usage["prompt_tokens"] == len(ours) + len(new)
        assert got.usage["prompt_tokens_details"]["cached_tokens"] == len(ours)
        assert after["prefilled_tokens"] - before["prefilled_tokens"] == len(new) - 1
        want = await complete(ref, [*ours, *new])
        assert (got.text, got.finish) == (want.text, want.finish)

        # a stop string that begins inside a token, first found there
        k, start = next(
            (k, s)
            for k in range(1, n)
            for s in range(ends[k] + 1, ends[k + 1])
            if text.find(text[s : s + 3]) == s and len(text[s : s + 3]) == 3
        )
        stop = text[start : start + 3]
        assert start not in ends
        cut = await chat(srv, USER, stream, max_tokens=16, stop=[stop])
        assert (cut.text, cut.finish) == (text[:start], "stop")
        assert srv.last().reply is None
        follow = [*USER, {"role": "assistant", "content": cut.text}, *USER]
        got = await chat(srv, follow, stream)
        want = await chat(ref, follow, False)
        assert got.usage["prompt_tokens"] == len(templated(tok, follow))
        assert (got.text, got.finish) == (want.text, want.finish)
        assert (await srv.stats())["prefix_cache"]["reply_follow_ups"] == 1  # the first


# ------------------------------------------------------------------ the cache itself


class CharTok:
    """A tokenizer of one id per character (id 2, "<E>", ends a turn; so does id 3, whose
    text is "<E>" too), with a template."""

    eos_token_ids = {2}

    def __init__(self, template: str) -> None:
        self.template = jinja2.Environment().from_string(template)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool, tokenize: bool
    ) -> str:
        assert not tokenize
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out: list[int] = []
        for part in re.split("(<E>)", text):
            out.extend([2] if part == "<E>" else [ord(c) for c in part])
        return out

    def decode(self, ids: list[int], **kw: Any) -> str:
        return "".join("<E>" if i in (2, 3) else chr(i) for i in ids)


def chatml(content: str = "message['content']", last_user: str = "") -> str:
    return (
        "{%- for message in messages %}"
        "{{- '[' + message['role'] + ']' + "
        + content
        + " + '<E>' }}"
        + last_user
        + "{%- endfor %}{%- if add_generation_prompt %}{{- '[assistant]' }}{%- endif %}"
    )


ASK = [{"role": "user", "content": "hi"}]
NEXT = [{"role": "user", "content": "more"}]


def said(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


async def test_follow_up_prompt_continues_only_where_the_template_says_the_same():
    """The stream, then the template's tokens after the reply; where the template renders
    the reply otherwise than verbatim (trims it, drops its reasoning) or the earlier
    messages otherwise once a reply follows, None: the caller templates the whole."""
    tok = CharTok(chatml())
    prompt = tok.encode("[user]hi<E>[assistant]")
    gen = [900, 901]  # ids the model chose; decoded they are not "ok" (chr(900)...)
    tail = tok.encode("[user]more<E>[assistant]")
    got = follow_up_prompt(tok, [*prompt, *gen, 2], [*ASK, *said("ok"), *NEXT], 1)
    assert got == [*prompt, *gen, 2, *tail]  # the model's end of turn is not doubled
    tok.eos_token_ids = {2, 3}
    got = follow_up_prompt(tok, [*prompt, *gen, 3], [*ASK, *said("ok"), *NEXT], 1)
    assert got == [*prompt, *gen, 3, *tail]  # the id the model ended with is kept
    got = follow_up_prompt(tok, [*prompt, *gen], [*ASK, *said("ok"), *NEXT], 1)
    assert got == [*prompt, *gen, *tok.encode("<E>"), *tail]  # cut: the template's end
    got = follow_up_prompt(tok, [*prompt, *gen, 0], [*ASK, *said("ok"), *NEXT], 1)
    assert got == [*prompt, *gen, 0, *tok.encode("<E>"), *tail]  # 0 does not end turns
    tok.eos_token_ids = {2, 3, 7}  # an end of turn the template does not write: its own
    got = follow_up_prompt(tok, [*prompt, *gen, 7], [*ASK, *said("ok"), *NEXT], 1)
    assert got == [*prompt, *gen, *tok.encode("<E>"), *tail]
    assert follow_up_prompt(tok, [*prompt, *gen], [*ASK, *said("ok")], 1) is not None
    assert follow_up_prompt(tok, [*prompt, *gen], [*ASK, *ASK, *NEXT], 1) is None  # no reply
    marked = [{"role": "user", "content": REPLY_MARK}]  # the marker elsewhere: not found
    assert follow_up_prompt(tok, [*prompt, *gen], [*ASK, *said("ok"), *marked], 1) is None

    trims = CharTok(chatml("(message['content'] | trim)"))
    assert follow_up_prompt(trims, prompt, [*ASK, *said("ok"), *NEXT], 1) is not None
    assert follow_up_prompt(trims, prompt, [*ASK, *said(" ok\n"), *NEXT], 1) is None
    drops = CharTok(chatml("message['content'].split('</think>')[-1]"))
    assert follow_up_prompt(drops, prompt, [*ASK, *said("ok"), *NEXT], 1) is not None
    assert follow_up_prompt(drops, prompt, [*ASK, *said("<think>x</think>ok"), *NEXT], 1) is None
    # the last user message rendered otherwise once a reply follows it
    marks_last = CharTok(chatml(last_user="{%- if loop.last %}{{- '!' }}{%- endif %}"))
    assert follow_up_prompt(marks_last, prompt, [*ASK, *said("ok"), *NEXT], 1) is None


async def test_prefix_cache_follow_up_needs_the_exact_messages_and_reply():
    tok = CharTok(chatml())
    prompt = tok.encode("[user]hi<E>[assistant]")
    seq = Sequence_(cache=[], tokens=[*prompt, 900, 901, 2, 5], cached=len(prompt) + 2)
    cache = PrefixCache(capacity=4)
    cache.put(seq, ChatReply(list(ASK), "ok", end=len(prompt) + 3))
    tail = tok.encode("[user]more<E>[assistant]")
    assert cache.follow_up(tok, [*ASK, *said("ok"), *NEXT]) == [*prompt, 900, 901, 2, *tail]
    for messages in (
        [*ASK, *said("ok ")],
        [*ASK, *said("Ok"), *NEXT],
        [{"role": "user", "content": "hi!"}, *said("ok"), *NEXT],
        [{"role": "system", "content": "s"}, *ASK, *said("ok"), *NEXT],
        [*ASK, {"role": "user", "content": "ok"}, *NEXT],
        ASK,
    ):
        assert cache.follow_up(tok, messages) is None, messages
    # the longest history of ours wins
    longer = [*ASK, *said("ok"), *NEXT]
    prompt2 = [*prompt, 900, 901, 2, *tail]
    seq2 = Sequence_(cache=[], tokens=[*prompt2, 903], cached=len(prompt2))
    cache.put(seq2, ChatReply(longer, "yes", end=len(prompt2) + 1))
    again = tok.encode("<E>[user]more<E>[assistant]")
    assert cache.follow_up(tok, [*longer, *said("yes"), *NEXT]) == [*prompt2, 903, *again]
    # a cached sequence whose stream no longer holds the reply's end is not used
    seq2.tokens = seq2.tokens[:-1]
    assert cache.follow_up(tok, [*longer, *said("yes"), *NEXT]) is None


async def test_prefix_cache_with_replies_stays_bounded(vault):
    """Capacity and bytes bound the replies kept too (their text counts), and a reply
    whose sequence is gone is never continued."""
    async with Engine.open(vault.path) as engine:
        r = engine.debug.runner
        seqs = [
            await engine.debug.compute.run(r.start, list(range(5 + i, 45 + i)), SamplingParams())
            for i in range(3)
        ]
        one = sum(c.nbytes for c in seqs[0].cache)
        text = "é" * 100  # 200 bytes in UTF-8
        history = [{"role": "user", "content": "hi"}]
        replies = [ChatReply(history, text, end=40) for _ in seqs]
        cache = PrefixCache(capacity=8, max_bytes=2 * (one + 202))
        for s, reply in zip(seqs, replies, strict=True):
            cache.put(s, reply)
        assert [e.seq for e in cache.entries] == [seqs[2], seqs[1]]
        assert cache.nbytes() == 2 * (one + 202)
        cache = PrefixCache(capacity=8, max_bytes=2 * (one + 202) - 1)
        for s, reply in zip(seqs, replies, strict=True):
            cache.put(s, reply)
        assert [e.seq for e in cache.entries] == [seqs[2]]  # the text tipped the balance
        cache = PrefixCache(capacity=1)
        for s, reply in zip(seqs, replies, strict=True):
            cache.put(s, reply)
        assert [e.seq for e in cache.entries] == [seqs[2]]
        cache.take(seqs[2].tokens)
        follow = [*history, {"role": "assistant", "content": text}, *history]
        assert cache.entries == [] and cache.follow_up(engine.tokenizer, follow) is None
