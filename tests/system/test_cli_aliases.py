"""The flags users bring from mlx-lm, llama.cpp and ollama (issue 51): -m/--model, -p,
-n, -c/--ctx-size, --temperature, --verbose, chat's --system-prompt, and `smoe generate
MODEL "prompt"` (ollama run's shape) mean what ours mean; a flag nobody has prints the
subcommand's usage, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from smoe.chat.demo import demo_vault
from smoe.cli import build_parser


def parse(*argv: str):
    """argv as main parses it: the parser, then what a flag or positional stands for."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.settle(args, args.command_parser)
    return args


def test_generate_takes_the_other_tools_spellings():
    ours = parse(
        "generate", "M", "--prompt", "hi", "--max-tokens", "7", "--max-context", "512",
        "--temp", "0.5",
    )  # fmt: skip
    for theirs in (
        parse("generate", "-m", "M", "-p", "hi", "-n", "7", "-c", "512", "--temperature", "0.5"),
        parse("generate", "--model", "M", "hi", "-n", "7", "--ctx-size", "512", "--temp", "0.5"),
        parse("generate", "M", "hi", "-n", "7", "-c", "512", "--temperature", "0.5", "--verbose"),
    ):
        for key in ("vault", "prompt", "max_tokens", "max_context", "temp"):
            assert getattr(theirs, key) == getattr(ours, key), key
    assert ours.vault == Path("M") and ours.prompt == "hi"


def test_chat_and_plan_take_them_too():
    ours = parse("chat", "M", "--system", "be brief", "--max-tokens", "9", "--temp", "0.3")
    theirs = parse(
        "chat", "-m", "M", "--system-prompt", "be brief", "-n", "9", "--temperature", "0.3"
    )
    for key in ("vault", "system", "max_tokens", "temp"):
        assert getattr(theirs, key) == getattr(ours, key), key
    assert parse("chat").vault is None  # the demo
    plan = build_parser().parse_args(["plan", "M", "-c", "1024"])
    assert (
        plan.context
        == 1024
        == build_parser().parse_args(["plan", "M", "--ctx-size", "1024"]).context
    )


def test_serve_takes_llama_servers_model_flag():
    for argv in (("serve", "M"), ("serve", "-m", "M"), ("serve", "--model", "M", "-c", "512")):
        assert parse(*argv).vault == Path("M")
    assert parse("serve").vault is None  # the demo


def test_a_positional_prompt_is_the_prompt(run_cli):
    vault = str(demo_vault())
    runs = [
        ("generate", vault, "--prompt", "Who was Moses?"),
        ("generate", vault, "Who was Moses?"),
        ("generate", "-m", vault, "Who was Moses?"),
    ]
    tokens = []
    for argv in runs:
        code, out, err = run_cli(*argv, "-n", "6", "--json")
        assert code == 0, err
        tokens.append(json.loads(out)["tokens"])
    assert tokens[0] == tokens[1] == tokens[2] and len(tokens[0]) > 0


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["generate", "M", "--bogus"], "unrecognized arguments: --bogus"),
        (["chat", "--bogus"], "unrecognized arguments: --bogus"),
        (["plan", "M", "--bogus"], "unrecognized arguments: --bogus"),
        (["generate", "-m", "M", "N", "hi"], "give the model once"),
        (["generate", "M", "hi", "-p", "hi"], "give the prompt once"),
        (["generate", "-p", "hi"], "required: MODEL (or -m/--model MODEL)"),
    ],
)
def test_a_usage_error_prints_the_subcommands_usage(run_cli, capsys, argv, said):
    with pytest.raises(SystemExit) as done:
        run_cli(*argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and "Traceback" not in err
    assert err.startswith(f"usage: smoe {argv[0]} ") and said in err.splitlines()[-1]
