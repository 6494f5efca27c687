"""One request's generation settings in `smoe serve`: validated fields (any API's, in
OpenAI's names: smoe/serve/validate.py's ``engine_fields``) with the server's defaults
for what the request did not say, and the room its reply has in the context."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smoe.errors import SmoeError
from smoe.sampling import SamplingParams
from smoe.serve.api_error import ApiError
from smoe.serve.logprobs import asked
from smoe.serve.options import ServerOptions

__all__ = ["RequestOptions", "request_options"]


@dataclass
class RequestOptions:
    max_tokens: int  # not sent: as many as the context has room for, up to 256
    params: SamplingParams
    stream: bool
    stops: list[str]
    stop_at_eos: bool


def request_options(
    fields: dict[str, Any],
    prompt: int,
    chat: bool,
    defaults: ServerOptions,
    vocab: int,
    max_context: int,
) -> RequestOptions:
    """The generation settings of validated ``fields`` for a ``prompt`` of so many tokens
    (``defaults``: the server's temperature, top_p and max_tokens). ApiError 400
    (context_length_exceeded) if the reply has no room in ``max_context``."""
    top_k = fields["top_k"]
    logprobs, prompt_logprobs = asked(fields, chat)
    o = defaults
    temperature = o.temperature if fields["temperature"] is None else fields["temperature"]
    top_p = o.top_p if fields["top_p"] is None else fields["top_p"]
    params = SamplingParams(
        # top_p 0 keeps only the likeliest token, which is greedy decoding
        temperature=0.0 if top_p == 0 else temperature,
        top_p=top_p or 1.0,
        top_k=0 if top_k < 0 or top_k >= vocab else top_k,  # all tokens: off
        min_p=fields["min_p"],
        repetition_penalty=fields["repetition_penalty"],
        presence_penalty=fields["presence_penalty"],
        frequency_penalty=fields["frequency_penalty"],
        seed=fields["seed"],
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=fields.get("logit_bias", ()),
    )
    try:
        params.check()  # validation is stricter; this guards against drift
    except SmoeError as e:
        raise ApiError(400, str(e)) from None
    room = max_context - prompt
    max_tokens = fields["max_tokens"]  # (0: with echo, the prompt only)
    if max_tokens is None:
        max_tokens = fields["max_completion_tokens"]
    if max_tokens is None:
        max_tokens = max(1, min(o.max_tokens, room))
    if max_tokens > room:
        raise ApiError(
            400,
            f"{prompt} prompt tokens + {max_tokens} to generate exceed the context "
            f"of {max_context} tokens; shorten the prompt or lower max_tokens",
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )
    return RequestOptions(
        max_tokens=max_tokens,
        params=params,
        stream=fields["stream"],
        stops=fields["stop"],
        stop_at_eos=not fields["ignore_eos"],  # vLLM's extension
    )
