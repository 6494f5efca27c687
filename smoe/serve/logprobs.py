"""Log-probabilities in `smoe serve`: the request fields that ask for them (and
``logit_bias``), and the answers' ``logprobs`` in OpenAI's two shapes.

The numbers are the engine's (``Event.logprob``, ``Event.top_logprobs``,
``Event.prompt_logprobs``; smoe.compute.logprobs): the model's log-softmax in float32,
before ``logit_bias`` and the penalties (vLLM's default). The completions endpoint takes
``logprobs`` as a count (0..5) and answers with four lists, ``tokens``, ``token_logprobs``,
``top_logprobs`` (a {token: logprob} object per token: its ``logprobs`` likeliest tokens
and the token itself, so up to logprobs + 1 entries) and ``text_offset``; with ``echo``
the prompt comes first, its first token's number null. The chat endpoint takes
``logprobs: true`` and ``top_logprobs`` (0..20) and answers ``{"content": [{token,
logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``. A token's text is that id
decoded alone (vLLM's way), ``bytes`` its UTF-8, ``text_offset`` the sum of the texts
before it in the choice.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from smoe.sampling import LOGIT_BIAS_RANGE, TokenLogprob
from smoe.serve.api_error import ApiError
from smoe.serve.describe import is_int, noun, show

MAX_CHOICES = 128  # n x prompts in one request (OpenAI's largest n)
FLOOR = -9999.0  # what a number below it (or -inf) is sent as: JSON has no -Infinity (vLLM's)
_ID = re.compile(r"[0-9]{1,12}")


def check_logit_bias(
    name: str, value: dict[str, Any], limits: Any
) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: {"token id": bias in -100..100}; the pairs, sorted."""
    pairs = []
    for key, bias in value.items():
        if not _ID.fullmatch(key) or int(key) >= limits.vocab:
            raise ApiError(
                400,
                f"Invalid '{name}': expected token ids between 0 and {limits.vocab - 1} as "
                f"keys, but got {show(key)} instead.",
                param=name,
                code="invalid_value",
            )
        where = f"{name}.{key}"
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise ApiError(
                400,
                f"Invalid type for '{where}': expected a number, but got {noun(bias)} instead.",
                param=where,
                code="invalid_type",
            )
        if not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
            kind = "integer" if is_int(bias) else "decimal"
            side = "below_min" if bias < 0 else "above_max"
            raise ApiError(
                400,
                f"Invalid '{where}': expected a number between -100 and 100, "
                f"but got {show(bias)} instead.",
                param=where,
                code=f"{kind}_{side}_value",
            )
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def check_together(fields: dict[str, Any], endpoint: str, limits: Any) -> None:
    """What fields allow together: chat's ``top_logprobs`` needs ``logprobs``;
    ``max_tokens`` 0 only with ``echo`` (the prompt's numbers, lm-eval's loglikelihood);
    n x prompts at most MAX_CHOICES. ApiError 400 naming the field."""
    if endpoint == "chat" and fields["top_logprobs"] and not fields["logprobs"]:
        raise ApiError(
            400,
            "Invalid 'top_logprobs': it needs 'logprobs' set to true.",
            param="top_logprobs",
            code="invalid_value",
        )
    for name in ("max_tokens", "max_completion_tokens"):
        if fields[name] == 0 and not (endpoint == "completions" and fields["echo"]):
            raise ApiError(
                400,
                f"Invalid '{name}': expected an integer between 1 and {limits.max_tokens}, "
                "but got 0 instead (0 only with 'echo': the prompt alone).",
                param=name,
                code="integer_below_min_value",
            )
    prompts = len(fields["prompt"]) if endpoint == "completions" else 1
    if fields["n"] * prompts > MAX_CHOICES:
        raise ApiError(
            400,
            f"Invalid 'n': {fields['n']} choices for each of {prompts} prompts exceed "
            f"{MAX_CHOICES} choices a request.",
            param="n",
            code="integer_above_max_value",
        )


def asked(fields: dict[str, Any], chat: bool) -> tuple[int | None, int | None]:
    """(alternatives per generated token, per prompt token) that validated ``fields``
    ask for; None: no numbers."""
    if chat:  # (the other APIs' fields have none of these: smoe.serve.validate.engine_fields)
        return (fields.get("top_logprobs", 0) if fields.get("logprobs") else None), None
    k = fields.get("logprobs")
    return k, (k if k is not None and fields.get("echo") else None)


class TokenText:
    """Each id's text decoded alone (vLLM's token strings), remembered."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.known: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self.known.get(token)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token}"
            else:
                decoded = self.tokenizer.decode([token])
                text = decoded if isinstance(decoded, str) else ""
            if len(self.known) < 1 << 18:
                self.known[token] = text
        return text


@dataclass
class LogprobLog:
    """One choice's numbers as they come, given out in OpenAI's shape (``chat``: the
    chat endpoint's) whole (``all``) or since the last take (``take``, for a stream)."""

    chat: bool
    text: TokenText
    entries: list[TokenLogprob | tuple[int, None]] = field(default_factory=list)
    sent: int = 0  # entries given out by ``take``
    offset: int = 0  # text_offset of the next entry given out

    def prompt(self, ids: list[int], scores: list[TokenLogprob]) -> None:
        """The prompt's entries: its first token (no number), then one per later token."""
        self.entries.append((ids[0], None))
        self.entries.extend(scores)

    def token(self, token: int, logprob: float, top: tuple[tuple[int, float], ...]) -> None:
        self.entries.append(TokenLogprob(token, logprob, top))

    def all(self) -> dict[str, Any]:
        return self._shape(self.entries, 0)

    def take(self) -> dict[str, Any] | None:
        """The entries since the last take (None: none)."""
        new = self.entries[self.sent :]
        if not new:
            return None
        self.sent = len(self.entries)
        out = self._shape(new, self.offset)
        self.offset += sum(len(self.text(e[0] if isinstance(e, tuple) else e.token)) for e in new)
        return out

    def _shape(self, entries: list[Any], offset: int) -> dict[str, Any]:
        if self.chat:
            return {"content": [self._chat(e) for e in entries]}
        tokens: list[str] = []
        numbers: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for e in entries:
            if isinstance(e, tuple):  # a prompt's first token: no number
                token, number, top = e[0], None, None
            else:
                token, mine = e.token, _number(e.logprob)
                alts: dict[str, float] = {}
                for alt, value in e.top:
                    alts.setdefault(self.text(alt), _number(value))
                alts.setdefault(self.text(token), mine)  # the token itself, always
                number, top = mine, alts
            text = self.text(token)
            tokens.append(text)
            numbers.append(number)
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": numbers,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _chat(self, e: TokenLogprob) -> dict[str, Any]:
        entry = self._alt(e.token, e.logprob)
        entry["top_logprobs"] = [self._alt(alt, value) for alt, value in e.top]
        return entry

    def _alt(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.text(token)
        bytes_ = list(text.encode("utf-8", errors="replace"))
        return {"token": text, "logprob": _number(logprob), "bytes": bytes_}


def _number(x: float) -> float:
    return x if math.isfinite(x) and x > FLOOR else FLOOR
