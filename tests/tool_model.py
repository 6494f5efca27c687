"""A tiny vault whose model calls a tool: the serve tests' tool-call checkpoint.

The demo and synth models never emit a tool call, so this one is made to, deterministically:
a `smoe synth` qwen3_moe (tiny) whose tokenizer gets a Qwen2.5-style chat template with
tools (so mlx-lm picks its ``json_tools`` parser) and three added tokens: ``<tool_call>``,
the call's JSON, ``</tool_call>``. Its weights are edited into a bigram chain: the last
token of the generation prompt -> ``<tool_call>`` -> the JSON -> ``</tool_call>`` ->
``<|im_end|>``. Each chain token's embedding is scaled up so it dominates the residual
stream (every sublayer is pre-normed, so its output stays O(1)), and ``lm_head``'s row for
its successor is that embedding, normed: the successor's logit wins by a wide margin. The
rest of the model (attention, routed experts) still runs and streams as usual.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CALL_NAME = "get_weather"
CALL_ARGUMENTS = {"city": "Paris"}
CALL_JSON = "\n" + json.dumps({"name": CALL_NAME, "arguments": CALL_ARGUMENTS}) + "\n"
ADDED = ("<tool_call>", CALL_JSON, "</tool_call>")

# Qwen2.5's template, shortened: tools into the system turn, calls as <tool_call> JSON,
# tool results as <tool_response> in a user turn.
TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n'
    "</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": CALL_NAME,
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def tool_vault(root: Path, seed: int = 5) -> Any:
    """A converted vault (float32) whose greedy reply to any chat prompt is one call of
    ``get_weather`` with ``{"city": "Paris"}`` in Qwen's ``<tool_call>`` format."""
    from smoe.synth import synthesize
    from smoe.vault.convert import ConvertOptions, convert

    src = synthesize(root / "tool-src", arch="qwen3_moe", preset="tiny", seed=seed)
    ids = _retokenize(src)
    _chain_weights(src, ids)
    return convert(src, root / "tool-vault", ConvertOptions(dtype="float32"))


def _retokenize(src: Path) -> list[int]:
    """Give the BPE's last three merges' ids to the added tokens (no merge builds on the
    last ones) and install the tools template; return the chain's ids, prompt end first."""
    path = src / "tokenizer.json"
    data = json.loads(path.read_text())
    model = data["model"]
    top = len(model["vocab"]) - len(ADDED)
    dropped = model["merges"][-len(ADDED) :]
    del model["merges"][-len(ADDED) :]
    model["vocab"] = {t: i for t, i in model["vocab"].items() if i < top}
    assert len(dropped) == len(ADDED)
    for i, content in enumerate(ADDED):
        data["added_tokens"].append(
            {
                "id": top + i,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": False,
            }
        )
    path.write_text(json.dumps(data))
    config_path = src / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    config_path.write_text(json.dumps(config))

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    prompt = tok.encode(text, add_special_tokens=False)
    return [int(prompt[-1]), top, top + 1, top + 2, int(tok.convert_tokens_to_ids("<|im_end|>"))]


def _chain_weights(src: Path, chain: list[int]) -> None:
    """Each chain id's successor wins by a wide margin (see the module doc)."""
    import mlx.core as mx

    (path,) = src.glob("*.safetensors")
    weights = dict(mx.load(str(path)))
    emb = weights["model.embed_tokens.weight"].astype(mx.float32)
    head = weights["lm_head.weight"].astype(mx.float32)
    norm = weights["model.norm.weight"].astype(mx.float32)
    for a, b in zip(chain, chain[1:], strict=False):
        e = emb[a] * 1000.0  # dominates the O(1) sublayer outputs added to it
        emb[a] = e
        normed = e / mx.sqrt(mx.mean(e * e)) * norm  # model.norm of it, as the head sees it
        head[b] = 4.0 * normed
    dtype = weights["lm_head.weight"].dtype
    weights["model.embed_tokens.weight"] = emb.astype(dtype)
    weights["lm_head.weight"] = head.astype(dtype)
    mx.save_safetensors(str(path), weights, metadata={"format": "pt"})
