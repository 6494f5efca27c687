"""Conversations: multi-turn chats that keep their KV cache and token stream.

A turn's prompt is the token stream so far (every prompt and the ids the model generated,
never the reply's text tokenized again, which may give other ids) followed by the chat
template's text for the new turn; the cache is trimmed to the prefix it shares with that and
only the rest is prefilled. So a follow-up turn costs its new tokens, not the history.
Where the template renders past turns differently once a reply follows (some strip a
reply's reasoning), the whole message list is templated again instead (``follow_up_prompt``,
which `smoe serve` shares for the replies its clients send back).

    conv = engine.conversation(system="Be brief.")
    async for event in conv.send("Hello!"):
        print(event.text, end="")
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiofiles.os
import anyio
import numpy as np

from smoe.compute.sequence import Sequence_
from smoe.engine import conversation_file
from smoe.engine.group import point
from smoe.errors import SmoeError
from smoe.sampling import SamplingParams
from smoe.util.files import atomic_path, sweep_stale

if TYPE_CHECKING:
    from smoe.engine import Engine, Event, GenerationStats

FORMAT = conversation_file.FORMAT


def vault_fingerprint(engine: Engine) -> str:
    """Identifies the weights a KV cache was computed with (conversation_file)."""
    v = engine.vault
    return conversation_file.vault_fingerprint_of(
        v.manifest.checksums, v.backbone_path, engine.dtype
    )


REPLY_MARK = "\ue000smoe-reply\ue001"  # private-use characters: no template writes them


def follow_up_prompt(
    tok: Any, stream: Sequence[int], messages: list[dict[str, str]], reply: int
) -> list[int] | None:
    """The prompt for ``messages`` that continues a token stream instead of templating the
    whole history again: ``stream`` then the template's tokens for what follows the reply.

    ``messages[reply]`` is an assistant reply that the model generated: ``stream`` is the
    prompt it was generated from (made for ``messages[:reply]``) followed by the ids it
    generated, whose text is the message's content, and, when the model ended its turn,
    that end-of-turn id. The reply's text is never tokenized again (which may give other
    ids); so only the new messages' tokens (template tokens included) are prefilled.

    The prompt's text is the template's text for ``messages``, and it differs from the
    templated prompt only in the reply's ids (and in those of earlier replies continued the
    same way). None (template the whole list instead) where that could not hold: the
    template renders the earlier messages otherwise once a reply follows them, or renders
    the reply's text otherwise than verbatim (trimmed, its reasoning dropped), or writes
    the marker it is located by (private-use characters) anywhere else.
    """
    said = messages[reply] if 0 < reply < len(messages) else None
    if not stream or said is None or said.get("role") != "assistant":
        return None
    marked = [*messages[:reply], {**said, "content": REPLY_MARK}, *messages[reply + 1 :]]
    text = tok.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
    if not isinstance(text, str) or text.count(REPLY_MARK) != 1:
        return None
    head, tail = text.split(REPLY_MARK)
    before = tok.apply_chat_template(messages[:reply], add_generation_prompt=True, tokenize=False)
    if head != before:  # past turns render otherwise once a reply follows
        return None
    whole = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if whole != head + said["content"] + tail:  # the reply is not rendered as it was said
        return None
    ids = list(stream)
    eos = set(getattr(tok, "eos_token_ids", None) or [])
    if ids[-1] in eos:  # the reply ended with the turn's end: not twice
        end = tok.decode([ids[-1]])
        if end and tail.startswith(end):
            tail = tail[len(end) :]
        else:  # an end the template does not write there: the template's own end instead
            ids.pop()
    return [*ids, *(int(t) for t in tok.encode(tail, add_special_tokens=False))]


class Conversation:
    """A chat on one engine. Its turns run one at a time; turns of different
    conversations on one engine are decoded together (the engine's batcher).

    Cancelling a reply (breaking out of ``send`` or cancelling its task) keeps what was
    generated: the partial reply stays in ``messages`` and in the stream, and the next turn
    continues from there.
    """

    def __init__(self, engine: Engine, system: str | None = None) -> None:
        self.engine = engine
        self.system = system
        self.messages: list[dict[str, str]] = []
        self._seq: Sequence_ | None = None
        # Stream length that ends with the last reply as it was generated (and shown): the
        # ids the next turn continues from; None when the history is to be templated.
        self._reply_end: int | None = None
        self._busy = asyncio.Lock()  # one turn (or save, fork) of this conversation at a time
        self.last_stats: GenerationStats | None = None
        self.reset(system)

    # -------------------------------------------------------------- state
    @property
    def tokens(self) -> list[int]:
        """The token stream: every templated prompt and reply so far."""
        return list(self._seq.tokens) if self._seq else []

    def reset(self, system: str | None = None) -> None:
        """Forget the history (and the cache); keep or replace the system prompt."""
        if system is not None:
            self.system = system
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self._seq = None
        self._reply_end = None

    def template(self, messages: list[dict[str, str]]) -> list[int]:
        tok = self.engine.tokenizer
        if tok is None:
            raise SmoeError(f"{self.engine.vault.path} has no tokenizer: cannot chat")
        if getattr(tok, "chat_template", None) is None:
            raise SmoeError(f"{self.engine.vault.path} has no chat template: use generate")
        try:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # the template is the vault's code (jinja2): any error
            raise SmoeError(
                f"the chat template of {self.engine.vault.path} failed: {type(e).__name__}: {e}"
            ) from None
        # (a BatchEncoding from some tokenizers: a mapping, not a dict)
        return [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]

    def _prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt for ``messages`` (the history plus a new user message)."""
        follow = self._follow_up(messages)
        return follow if follow is not None else self.template(messages)

    def _follow_up(self, messages: list[dict[str, str]]) -> list[int] | None:
        """The stream up to the last reply's generated ids, then the template's tokens after
        that reply (``follow_up_prompt``); None where that would not be what the template
        says, or when ``messages`` is not the history plus new messages."""
        if self._seq is None or self._reply_end is None or len(messages) < 2:
            return None
        history = messages[:-1]
        if history != self.messages or history[-1].get("role") != "assistant":
            return None
        stream = self._seq.tokens[: self._reply_end]
        try:
            return follow_up_prompt(self.engine.tokenizer, stream, messages, len(history) - 1)
        except Exception:  # the template (the vault's code) failed: ``template`` says how
            return None

    def _keep(self, seq: Sequence_, _run: int = 0) -> None:
        """Compute thread: the sequence this conversation's stream now lives in."""
        self._seq = seq

    # -------------------------------------------------------------- turns
    async def send(
        self,
        text: str,
        max_tokens: int = 512,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
    ) -> AsyncIterator[Event]:
        """Add a user message and stream the reply (events as ``Engine.generate``).

        Raises SmoeError before any work if the conversation would overflow the context:
        ``reset()`` (/reset in the REPL) starts over.
        """
        params = SamplingParams(temperature, top_p, top_k, min_p, repetition_penalty, seed=seed)
        params.check()
        messages = [*self.messages, {"role": "user", "content": text}]
        prompt = self._prompt(messages)
        self._check_context(prompt, max_tokens)
        # The reply is recorded as it streams, so the history is right at every moment,
        # also when the consumer stops iterating (a cancelled reply stays, partial).
        answer = {"role": "assistant", "content": ""}
        self.messages = [*messages, answer]
        self._reply_end = None  # until the reply's ids are known
        engine = self.engine
        shown, stopped = 0, False  # tokens handed out; whether the reply ended with EOS
        async with self._busy:
            stream = engine.stream(
                prompt, params, max_tokens, sequence=self._seq, on_prepared=self._keep
            )
            try:
                async for event in stream:
                    if event.token is not None:
                        shown += 1
                    if event.text:
                        answer["content"] += event.text
                    if event.finish_reason == "stop":
                        stopped = True  # its EOS id is in the stream, never shown
                    if event.stats is not None:
                        self.last_stats = event.stats
                    yield event
            finally:
                # A cancelled turn's last step may have run past what was shown: the next
                # turn continues from what the user saw.
                if self._seq is not None and self._seq.tokens[: len(prompt)] == prompt:
                    self._reply_end = len(prompt) + shown + stopped

    async def next_logits(self, text: str) -> np.ndarray:
        """Logits [vocab] of the reply's first token to ``text``, without sampling or
        changing ``messages`` (the prompt's keys stay cached for a later ``send``)."""
        prompt = self._prompt([*self.messages, {"role": "user", "content": text}])
        self._check_context(prompt, 1)

        parts = self.engine.debug.parts()
        runner = parts.runner

        def run() -> np.ndarray:
            seq, _ = point(runner, self._seq, prompt, SamplingParams())
            self._keep(seq)
            while runner.prefill_chunk(seq):
                pass
            return runner.next_logits(seq)

        async with self._busy, self.engine.exclusive():
            return await parts.compute.run(run)

    def _check_context(self, prompt: list[int], max_tokens: int) -> None:
        limit = self.engine.max_context
        if len(prompt) + max_tokens > limit:
            raise SmoeError(
                f"the conversation ({len(prompt)} tokens) plus {max_tokens} for the reply "
                f"would overflow the context of {limit} tokens; /reset to start over "
                "(or lower max_tokens, or start with a larger --max-context)"
            )

    # -------------------------------------------------------------- copies and files
    async def fork(self) -> Conversation:
        """An independent copy: same history and cache; turns on either don't affect the other.
        Waits for a turn of this conversation in progress to end."""
        async with self._busy:
            other = Conversation(self.engine, self.system)
            other.messages = [dict(m) for m in self.messages]
            other._reply_end = self._reply_end
            if self._seq is not None:
                seq = self._seq
                async with self.engine.exclusive():
                    parts = self.engine.debug.parts()
                    other._seq = await parts.compute.run(parts.runner.copy, seq)
            return other

    async def save(self, path: str | Path) -> Path:
        """Write history, token stream and KV cache to ``path`` (safetensors), atomically:
        a file already there stays whole until the new one replaces it. Waits for a turn of
        this conversation in progress to end. Raises SmoeError if the file cannot be written
        (missing directory, full disk)."""
        async with self._busy:
            return await self._save(Path(path))

    async def _save(self, path: Path) -> Path:
        from mlx_lm.models.cache import save_prompt_cache

        if path.suffix != ".safetensors":
            path = path.with_name(path.name + ".safetensors")
        meta = {
            "format": FORMAT,
            "vault": vault_fingerprint(self.engine),
            "model_type": self.engine.vault.manifest.shape.model_type,
            "system": json.dumps(self.system),
            "messages": json.dumps(self.messages),
            "kv_bits": json.dumps(self.engine.options.kv_bits),
        }
        # What saves killed before left; a directory listing, off the event loop.
        await anyio.to_thread.run_sync(lambda: sweep_stale(path.parent, suffix=".safetensors"))
        seq = self._seq

        def write(tmp: Path) -> None:
            # Read the stream here, under the engine lock: a cancelled turn's last step
            # may have run after the reply was taken.
            if seq is not None:
                _settle(self.engine.debug.parts().runner, seq)
            meta["tokens"] = json.dumps(seq.tokens if seq is not None else [])
            meta["cached"] = str(seq.cached if seq is not None else 0)
            meta["reply_end"] = json.dumps(self._reply_end)
            cache = seq.cache if seq is not None else self.engine.debug.parts().runner.new_cache()
            meta["digest"] = conversation_file.conversation_digest(
                meta, conversation_file.cache_arrays(cache)
            )
            try:
                save_prompt_cache(str(tmp), cache, meta)
            except RuntimeError as e:  # how mlx reports a file it cannot write
                raise OSError(str(e)) from None

        try:  # .chat.tmp-PID.safetensors: mlx appends .safetensors to a name without it
            with atomic_path(path, keep_suffix=True) as tmp:
                async with self.engine.exclusive():
                    await self.engine.debug.parts().compute.run(write, tmp)
        except (OSError, ValueError) as e:  # ValueError: a name the OS cannot take (a NUL)
            raise SmoeError(
                f"cannot save the conversation to {_shown(path)} ({e}); check the name, and that "
                "the directory exists and has space (a file already there is unchanged)"
            ) from None
        return path

    @classmethod
    async def load(cls, engine: Engine, path: str | Path) -> Conversation:
        """Read a conversation written by ``save``. Raises SmoeError (nothing else changes)
        if the file is unreadable, not a conversation, or was saved with another vault."""
        path = Path(path)
        suffixed = path.with_name(path.name + ".safetensors")
        # Checked with aiofiles: a slow or network file system does not stall the loop.
        if not await aiofiles.os.path.exists(path) and await aiofiles.os.path.exists(suffixed):
            path = suffixed
        if not await aiofiles.os.path.isfile(path):
            raise SmoeError(f"{path} does not exist")

        try:
            async with engine.exclusive():  # (the file is read on the compute thread)
                saved, cache = await engine.debug.parts().compute.run(_read, engine, path)
        except SmoeError:
            raise
        except Exception as e:  # whatever a crafted file does: one line, the chat stays
            why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            raise SmoeError(
                f"{path} could not be loaded ({why}); the conversation in progress is kept"
            ) from e
        conv = cls(engine, saved.system)
        conv.messages = saved.messages
        conv._seq = Sequence_(cache=cache, tokens=saved.tokens, cached=saved.cached)
        conv._reply_end = saved.reply_end
        return conv


def _settle(runner: Any, seq: Sequence_) -> None:
    """Compute thread: ``seq`` as a file can hold it. A pass built ahead is not part of the
    turn. A turn cancelled in the middle of a layer-major prefill left its layers out of
    step (those it passed hold more tokens than the rest): saved so, no engine could load
    the file. Each layer goes back to the tokens cached before that turn (which the next
    turn would otherwise throw away with the rest: Runner.prepare starts over)."""
    runner.settle(seq)
    if seq.prompt is None:
        return
    if not all(c.is_trimmable() for c in seq.cache):  # e.g. a sliding window: start over
        runner.reset(seq)
        return
    seq.prompt.close()
    seq.prompt = None
    for c in seq.cache:
        if c.offset > seq.cached:
            c.trim(c.offset - seq.cached)


def _read(engine: Engine, path: Path) -> tuple[conversation_file.Saved, list[Any]]:
    """Compute thread: the conversation file at ``path`` checked and read. Its header is
    checked (against the file's size and this model's cache) before any array is read:
    what a crafted header declares is never allocated (conversation_file)."""
    from mlx_lm.models.cache import load_prompt_cache

    fresh = engine.debug.parts().runner.new_cache()
    options = engine.options
    layout = conversation_file.layout_of(
        fresh,
        engine.dtype,
        engine.vault.config(),
        engine.max_context,
        options.kv_bits,
        engine.debug.parts().runner.kv_group_size,
    )
    header = conversation_file.read_header(path, layout.header_limit)
    meta = header.meta
    if meta.get("format") not in (FORMAT, conversation_file.FORMAT_1):
        raise SmoeError(f"{path} is not an S-MoE conversation file")
    if meta.get("vault") != vault_fingerprint(engine):
        raise SmoeError(
            f"{path} was saved with another model or dtype "
            f"({meta.get('model_type', '?')[:40]}); load it with the vault it was made with"
        )
    # absent: saved before kv_bits
    saved_bits = conversation_file.parse_field({"kv_bits": "null", **meta}, "kv_bits", path)
    if saved_bits != options.kv_bits:
        # Its keys/values were computed (and rounded) another way than this engine's.
        raise SmoeError(
            f"{path} was saved with "
            + (f"--kv-bits {saved_bits}" if saved_bits else "a full-precision KV cache")
            + "; load it with an engine opened with "
            + (f"--kv-bits {saved_bits}" if saved_bits else "no --kv-bits")
        )
    conversation_file.check_arrays(header, layout, path)
    try:
        # (mlx-lm's loader is untyped)
        cache, meta = load_prompt_cache(str(path), return_metadata=True)  # type: ignore[no-untyped-call]
    except Exception as e:  # a corrupt file: say so, keep the current chat
        raise SmoeError(f"{path} is not a readable conversation file ({e})") from None
    conversation_file.check_read(header, cache, meta, path)
    conversation_file.check_kept(cache, fresh, layout, path)
    vocab = engine.vault.manifest.shape.vocab_size
    saved = conversation_file.check(meta, cache, path, vocab, engine.max_context)
    return saved, cache


def _shown(path: object) -> str:
    """A path as the user typed it, on one line (a name with a newline is escaped)."""
    text = str(path)
    return text if text.isprintable() else repr(text)
