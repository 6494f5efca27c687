"""The server's prefix cache: KV caches of recent requests, and the chat replies they made.

A new prompt takes the cached sequence sharing its longest prefix (``PrefixCache.take``);
a chat request that repeats an earlier request's messages and our reply to them verbatim
continues from the ids that reply was generated as (``PrefixCache.follow_up``), so the
reply is never tokenized again. No MLX here: sequences are held, never computed on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from smoe.engine.conversation import follow_up_prompt
from smoe.engine.handles import SequenceHandle
from smoe.util.tokens import common_prefix

__all__ = ["Cached", "ChatReply", "PrefixCache", "kept_reply", "reply_ids"]


@dataclass
class ChatReply:
    """What a cached sequence holds of the chat request that made it: the request's
    ``messages``, the reply ``text`` its client was given, and ``end``, the stream length
    that ends with the ids of that text (and the end-of-turn id when the model ended its
    turn there). Made only where ``text`` is exactly what those ids decode to."""

    messages: list[dict[str, str]]
    text: str
    end: int

    def nbytes(self) -> int:
        """Bytes of text it keeps (UTF-8)."""
        parts = [self.text, *(m["content"] for m in self.messages)]
        return sum(len(t.encode("utf-8", "surrogatepass")) for t in parts)


@dataclass
class Cached:
    """One sequence of the prefix cache, with its chat reply if it has one."""

    seq: SequenceHandle
    reply: ChatReply | None = None
    text_bytes: int = 0  # what ``reply`` keeps

    def nbytes(self) -> int:
        return _cache_bytes(self.seq) + self.text_bytes


@dataclass
class PrefixCache:
    """KV caches of recent requests; a new prompt takes the one sharing its longest prefix.
    Keeps at most ``capacity`` caches and ``max_bytes`` of keys and values and of the chat
    replies' texts (oldest go).

    A chat request's sequence also keeps the reply its client was given (``ChatReply``), so
    that a request repeating that request's messages, then that reply verbatim, then new
    messages continues from the ids the reply was generated as (``follow_up``)."""

    capacity: int
    max_bytes: int = 2 * 1024**3
    entries: list[Cached] = field(default_factory=list)

    def take(self, prompt: list[int]) -> tuple[SequenceHandle | None, int]:
        """The sequence sharing the longest prefix with ``prompt`` (taken out of the
        cache), and that length; (None, 0) where none shares a token."""
        best, best_len = self._best(prompt)
        if best is None:
            return None, 0
        self.entries.remove(best)
        return best.seq, best_len

    def longest(self, prompt: list[int]) -> int:
        """How long a prefix of ``prompt`` ``take`` would find (the cache unchanged)."""
        return self._best(prompt)[1]

    def _best(self, prompt: list[int]) -> tuple[Cached | None, int]:
        best, best_len = None, 0
        for entry in self.entries:
            seq = entry.seq
            n = common_prefix(seq.tokens[: seq.cached], prompt)
            if n > best_len:
                best, best_len = entry, n
        return best, best_len

    def put(self, seq: SequenceHandle, reply: ChatReply | None = None) -> None:
        size = reply.nbytes() if reply is not None else 0
        self.entries.insert(0, Cached(seq, reply, size))
        del self.entries[self.capacity :]
        while self.entries and self.nbytes() > self.max_bytes:
            self.entries.pop()

    def follow_up(self, tok: Any, messages: list[dict[str, str]]) -> list[int] | None:
        """The prompt for chat ``messages`` that begin with a cached request's messages and
        our reply to them (its text exactly), when they do: that sequence's stream up to
        the reply's end, then the template's tokens for the messages after the reply
        (``follow_up_prompt``, as a Conversation's next turn). So the reply is never
        tokenized again. None where no cached reply is repeated, or the template says
        otherwise (the caller templates ``messages`` whole). Both halves in one call: the
        server runs ``repeated_reply`` on the event loop, the template work off it."""
        found = self.repeated_reply(messages)
        return None if found is None else reply_prompt(tok, messages, *found)

    def repeated_reply(self, messages: list[dict[str, str]]) -> tuple[list[int], int] | None:
        """The cached stream up to the end of a reply of ours that ``messages`` repeat, and
        how many messages preceded that reply; None where none is repeated. The longest
        history wins; of equals, the newest. Event loop only (the cache changes there)."""
        best: ChatReply | None = None
        stream: list[int] = []
        for entry in self.entries:
            r = entry.reply
            if r is None or len(r.messages) >= len(messages):
                continue
            if best is not None and len(r.messages) <= len(best.messages):
                continue
            said = messages[len(r.messages)]
            if said["role"] != "assistant" or said["content"] != r.text:
                continue
            if messages[: len(r.messages)] != r.messages:
                continue
            best, stream = r, entry.seq.tokens[: r.end]
        if best is None or len(stream) != best.end:
            return None
        return stream, len(best.messages)

    def nbytes(self) -> int:
        return sum(entry.nbytes() for entry in self.entries)


def _cache_bytes(seq: SequenceHandle) -> int:
    return seq.kv_bytes()


def reply_ids(tok: Any, ids: list[int], text: str, cut: bool) -> int | None:
    """How many of the generated ``ids`` the reply ``text`` is exactly the text of: all of
    them, or where ``cut`` (a stop string ended the text early) the fewest whose text it
    is; None where no such count exists (the text a client was given is not what the ids
    decode to: a detokenizer that dropped a leading space, a cut inside a token)."""

    def decode(n: int) -> str:
        out = tok.decode(ids[:n], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return out if isinstance(out, str) else ""

    if not cut:
        return len(ids) if decode(len(ids)) == text else None
    lo, hi = 0, len(ids)  # the fewest whose text is at least as long
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(mid)) >= len(text):
            hi = mid
        else:
            lo = mid + 1
    return lo if decode(lo) == text else None


def kept_reply(
    tok: Any,
    messages: list[dict[str, str]],
    ids: list[int],
    seq: SequenceHandle,
    generated: list[int],
    text: str,
    ended: bool,
    cut: bool,
) -> ChatReply | None:
    """What the prefix cache keeps of a chat request's reply (``PrefixCache.follow_up``
    continues from it), or None where the ``text`` the client was given is not exactly
    the text of ids in the stream: then a follow-up templates the messages whole.
    ``messages``: the request's; ``ids``: its prompt; ``seq``: the sequence it ran on;
    ``generated``: the ids shown; ``ended``: the model's end-of-turn id follows them;
    ``cut``: a stop string ended the text (the ids past it are not the reply)."""
    eos = set(getattr(tok, "eos_token_ids", None) or [])
    if any(t in eos for t in generated):  # ignore_eos: an end of turn inside the reply
        return None
    n = reply_ids(tok, generated, text, cut)
    if n is None:
        return None
    ended = ended and not cut
    start, end = len(ids), len(ids) + n + ended
    tokens = seq.tokens  # a cancelled request's last step may still append: read once
    if len(tokens) < end or tokens[:start] != ids or tokens[start : start + n] != generated[:n]:
        return None
    if ended and tokens[end - 1] not in eos:
        return None
    return ChatReply(messages, text, end)


def reply_prompt(
    tok: Any, messages: list[dict[str, str]], stream: list[int], reply: int
) -> list[int] | None:
    """``follow_up_prompt`` for a reply ``repeated_reply`` found; None where the template
    fails on it (the vault's code: the caller templates the messages whole)."""
    try:
        return follow_up_prompt(tok, stream, messages, reply)
    except Exception:
        return None
