"""`smoe generate` with text, as a user of mlx-lm's generate expects: the prompt goes
through the model's chat template (with an optional system message), ``-`` reads standard
input, ``--ignore-chat-template`` sends the raw text, and a reply that ends at once says why.

The reference is transformers' own ``apply_chat_template`` on the vault's tokenizer: the
ids the CLI runs must be exactly those (checked by running them as ``--prompt-ids``).
"""

from __future__ import annotations

import io
import json

import pytest
from transformers import AutoTokenizer

from smoe.chat.demo import demo_vault
from tests.conftest import rewrite_side_file

QUESTION = "Who was Moses?"


@pytest.fixture(scope="module")
def vault():
    return demo_vault()


@pytest.fixture(scope="module")
def tokenizer(vault):
    return AutoTokenizer.from_pretrained(str(vault))


def ids_csv(ids) -> str:
    return ",".join(str(int(i)) for i in ids)


def generate(run_cli, vault, *args: str) -> dict:
    code, out, err = run_cli("generate", vault, *args, "--max-tokens", "12", "--json")
    assert code == 0, err
    return json.loads(out)


def templated(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_text_goes_through_the_chat_template(run_cli, vault, tokenizer):
    got = generate(run_cli, vault, "--prompt", QUESTION)
    want = generate(
        run_cli,
        vault,
        "--prompt-ids",
        ids_csv(templated(tokenizer, [{"role": "user", "content": QUESTION}])),
    )
    assert got["tokens"] == want["tokens"] and len(got["tokens"]) > 0


def test_a_system_prompt_comes_first(run_cli, vault, tokenizer):
    system = "Answer in the words of the King James Bible."
    got = generate(run_cli, vault, "--prompt", QUESTION, "--system-prompt", system)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    want = generate(run_cli, vault, "--prompt-ids", ids_csv(templated(tokenizer, messages)))
    assert got["tokens"] == want["tokens"]


def test_ignore_chat_template_sends_the_raw_text(run_cli, vault, tokenizer):
    got = generate(run_cli, vault, "--prompt", QUESTION, "--ignore-chat-template")
    want = generate(run_cli, vault, "--prompt-ids", ids_csv(tokenizer.encode(QUESTION)))
    assert got["tokens"] == want["tokens"]


def test_a_dash_reads_the_prompt_from_standard_input(run_cli, vault, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(QUESTION))
    piped = generate(run_cli, vault, "--prompt", "-")
    assert piped["tokens"] == generate(run_cli, vault, "--prompt", QUESTION)["tokens"]


def test_a_reply_that_ends_at_once_says_why(run_cli, vault):
    # The raw question makes the demo end at once (its end token comes first).
    code, out, err = run_cli("generate", vault, "--prompt", QUESTION, "--ignore-chat-template")
    assert code == 0
    assert "[0 tokens, stop" in err
    assert "drop --ignore-chat-template" in err.splitlines()[-1]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--prompt-ids", "1,2", "--system-prompt", "x"], "--system-prompt goes with --prompt"),
        (
            ["--prompt", "hi", "--ignore-chat-template", "--system-prompt", "x"],
            "drop --ignore-chat-template",
        ),
    ],
)
def test_a_system_prompt_without_a_template_is_refused(run_cli, vault, args, needle):
    code, out, err = run_cli("generate", vault, *args)
    assert code != 0 and needle in err and "Traceback" not in err


def test_a_chat_template_that_raises_is_one_line(run_cli, vault, tmp_path):
    import shutil

    broken = tmp_path / "v"
    shutil.copytree(vault, broken)
    config = json.loads((broken / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ raise_exception('no such role') }}"
    rewrite_side_file(broken, "tokenizer_config.json", json.dumps(config).encode())
    rewrite_side_file(broken, "chat_template.jinja", None)
    code, out, err = run_cli("generate", broken, "--prompt", QUESTION)
    assert code != 0 and "Traceback" not in err
    assert "chat template" in err and "no such role" in err


def test_a_chat_template_that_fails_on_a_follow_up_is_one_error_and_the_chat_goes_on(
    vault, tmp_path
):
    """The template runs again on a follow-up turn (the reply's ids continued): a template
    that fails only there was a jinja2 traceback (issue 30). Now the turn is one SmoeError
    naming the template, and the conversation still takes a turn the template accepts."""
    import shutil

    from smoe.engine import Engine
    from smoe.errors import SmoeError
    from smoe.util.loop import run

    broken = tmp_path / "v"
    shutil.copytree(vault, broken)
    config = json.loads((broken / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if messages|length > 2 and messages[-1]['content'] == 'boom' %}"
        "{{ raise_exception('no follow-ups like that') }}{% endif %}"
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    rewrite_side_file(broken, "tokenizer_config.json", json.dumps(config).encode())
    rewrite_side_file(broken, "chat_template.jinja", None)

    async def chat():
        async with Engine.open(broken) as engine:
            conv = engine.conversation()
            [e async for e in conv.send("hello", max_tokens=3)]
            with pytest.raises(SmoeError) as failed:
                [e async for e in conv.send("boom", max_tokens=3)]
            assert "chat template" in str(failed.value) and "no follow-ups" in str(failed.value)
            return [e async for e in conv.send("fine", max_tokens=3)]

    assert run(chat())
