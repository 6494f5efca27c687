"""`smoe --help` and every subcommand's: each option explained with its default, the
engine's tuning knobs in a group of their own (issue 28)."""

from __future__ import annotations

import argparse

import pytest

from smoe.bench.policy import build_parser as policy_parser
from smoe.cli import build_parser

# The knobs `smoe generate/chat/serve --help` shows under "advanced", after the basics.
ADVANCED = {
    "--slots",
    "--workers",
    "--prefill-chunk",
    "--kv-bits",
    "--ring",
    "--policy",
    "--hint-depth",
    "--no-lookahead",
    "--spec",
    "--draft",
    "--draft-tokens",
}
BASIC = {"--memory", "--max-context", "--max-tokens", "--device", "--dtype", "--top-p"}
ADVANCED_TITLE = "advanced (ring and policy)"


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """(command line, parser) for `smoe`, every subcommand and sub-benchmark, and
    `smoe bench policy`'s own parser. argparse has no public walk: _actions it is."""
    found = []
    todo = [("smoe", build_parser())]
    while todo:
        name, parser = todo.pop()
        found.append((name, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += [(f"{name} {sub}", p) for sub, p in action.choices.items()]
    found.append(("smoe bench policy (own)", policy_parser("smoe bench policy")))
    return found


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    skip = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)
    return [a for a in parser._actions if not isinstance(a, skip)]


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0  # store_true / store_false / count take none


PARSERS = _parsers()


def test_every_subcommand_is_walked():
    names = {name for name, _ in PARSERS}
    for cmd in ("chat", "generate", "serve", "plan", "synth", "export", "convert", "inspect"):
        assert f"smoe {cmd}" in names
    for bench in ("io", "generate", "decode", "prefill", "resident", "locality", "trace"):
        assert f"smoe bench {bench}" in names


@pytest.mark.parametrize(("name", "parser"), PARSERS, ids=[n for n, _ in PARSERS])
def test_every_option_has_help(name, parser):
    missing = [a.dest for a in _options(parser) if not (a.help or "").strip()]
    assert not missing, f"{name}: options without help: {missing}"


@pytest.mark.parametrize(("name", "parser"), PARSERS, ids=[n for n, _ in PARSERS])
def test_every_optional_value_says_its_default(name, parser):
    """An option that takes a value and may be left out says what leaving it out means:
    the value ("default 4") or, where computed, in words ("default: the model's ...")."""
    silent = [
        a.option_strings[0] if a.option_strings else a.dest
        for a in _options(parser)
        if _takes_value(a)
        and not a.required
        and (a.option_strings or a.nargs == "?")
        and "default" not in (a.help or "")
    ]
    assert not silent, f"{name}: options that do not say their default: {silent}"


def test_help_shows_no_placeholder_defaults():
    """A computed default is described in words, never printed as None."""
    for name, parser in PARSERS:
        assert "default None" not in parser.format_help(), name
        assert "default: None" not in parser.format_help(), name


def _group(parser: argparse.ArgumentParser, title: str) -> set[str]:
    for group in parser._action_groups:
        if group.title == title:
            return {s for a in group._group_actions for s in a.option_strings}
    return set()


@pytest.mark.parametrize("cmd", ["generate", "chat", "serve"])
def test_tuning_knobs_are_in_the_advanced_group(cmd):
    parser = dict(PARSERS)[f"smoe {cmd}"]
    advanced = _group(parser, ADVANCED_TITLE)
    assert advanced == ADVANCED
    assert not BASIC & advanced
    text = parser.format_help()
    text = text[text.index("options:") :]  # the option list, not the usage lines
    # The basics come first, the knobs after them, under the group's title.
    assert text.index("--memory") < text.index(ADVANCED_TITLE) < text.index("--slots")
    assert text.index("--max-tokens") < text.index(ADVANCED_TITLE)


@pytest.mark.parametrize("cmd", ["generate", "chat", "serve"])
def test_grouping_changes_no_flag(cmd):
    """Every knob still parses to the same destination it did when they were flat."""
    parser = dict(PARSERS)[f"smoe {cmd}"]
    args = parser.parse_args(
        (["v"] if cmd == "generate" else [])
        + ["--slots", "9", "--workers", "3", "--prefill-chunk", "8", "--kv-bits", "8"]
        + ["--ring", "staged", "--policy", "lru", "--hint-depth", "5", "--no-lookahead"]
        + ["--spec", "2", "--draft", "ngram", "--draft-tokens", "3"]
    )
    assert (args.slots, args.workers, args.prefill_chunk, args.kv_bits) == (9, 3, 8, 8)
    assert (args.ring, args.policy, args.hint_depth, args.lookahead) == ("staged", "lru", 5, False)
    assert (args.spec, args.draft, args.draft_tokens) == (2, "ngram", 3)
