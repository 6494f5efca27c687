"""Every `smoe ...` command the docs show runs as written, or is skipped for a reason
listed here (issue 52).

The commands are read from the fenced blocks of README.md and docs/*.md: a line of a
shell block that runs `smoe` (or `python -m smoe.cli`, piped into, after `&&`, under
`mlx.launch ... --`), and each `$ smoe ...` line of a text block with the output the page
shows after it. For each command:

- **its flags** (every one, in a skipped command too, usage synopses' `[--flag X]` groups
  included) must be options of its subcommand's parser: a renamed or removed flag fails;
- **it runs** in-process on the CPU against the built-in demo model, unless the first
  pattern of ``SKIP`` that matches it names why not (a GPU, a server, the network,
  minutes). Placeholders are read as the demo where the meaning holds (``MODEL``,
  ``VAULT``, a download's folder: the demo's vault or its shipped checkpoint; a
  conversion's output: a new folder), and a few commands whose point needs other sizes
  are run as ``ADAPT`` says, with its reason. Chat and generate get ``--max-tokens 8``
  where the page gives no limit;
- **its output keeps its shape**: where the page shows output, the exit code (1 where
  it shows an error or "does not fit", else 0) and the shape of the lines it shows (the
  labels of `label  value` rows, in order; the memory line; the summary line; an error's
  first words) must be what the command prints now.

So a command added to the docs is either run here or listed in ``SKIP`` consciously, and
a changed default or flag fails the page that shows it. The relative links of README.md,
docs/*.md and the results/ notes are checked too.
"""

from __future__ import annotations

import io
import re
import shlex
import shutil
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_FENCES = {"", "bash", "sh", "shell", "console", "text"}

# Not run, each with why (the first pattern that matches the command as written wins).
# Their flags are still checked against the parser.
SKIP: list[tuple[str, str]] = [
    (
        r"\$\(",
        "its prompt is a shell substitution: cache-policy.md's 6,000-character "
        "held-out text a token a chunk (minutes); tests/unit/test_telemetry.py records archives",
    ),
    (
        r"^mlx\.launch ",
        "several processes under mlx.launch (docs/distributed.md): "
        "tests/system/test_distributed.py runs expert parallelism",
    ),
    (r"--device gpu\b", "needs a CUDA GPU: tests/gpu/ run on the device machine"),
    (
        r"^smoe serve\b",
        "a server runs until it is stopped: tests/system/test_serve_docs.py "
        "runs getting-started's start line and its clients, tests/system/test_serve*.py the rest",
    ),
    (r"--download\b", "fetches from the Hugging Face Hub: needs the network"),
    (
        r"^smoe \w+ (mlx-community|Qwen)/",
        "a Hub name resolves in the Hugging Face cache, so "
        "what it prints depends on that cache: tests/system/test_cli_hub_hints.py and "
        "test_hub_names.py cover both answers",
    ),
    (
        r"^smoe synth .*--preset qwen3-(30b-a3b|235b-a22b)",
        "writes a checkpoint of real expert "
        "geometry, gigabytes (minutes): tests/exact/test_synth.py synthesizes every preset small",
    ),
    (r"^smoe convert (r13/src|q30-6)\b", "converts that multi-GB synthetic checkpoint"),
    (
        r"^smoe bench io ",
        "a benchmark: seconds of timed reads per worker count and path "
        "(16 busy processes in gpu.md's line); tests/unit/test_streamer.py runs the reader",
    ),
    (
        r"^smoe bench policy ",
        "replays every policy against Belady over a whole routing "
        "archive (about 16 s): tests/unit/test_telemetry.py and test_replay.py",
    ),
    (
        r"--max-tokens 512 .*--routing-archive",
        "records a 512-token routing archive (seconds "
        "of decoding), the input of the `bench policy` line after it",
    ),
]

# Run otherwise than written, because the page's point needs the sizes of its own model:
# (pattern, {token written: token run}, why).
ADAPT: list[tuple[str, dict[str, str], str]] = [
    (
        r"^smoe (plan|generate) \S+ .*--memory 600MB",
        {"600MB": "300MB"},
        "a budget under the smallest: the q30 model's smallest is 671MB, the demo's 345MB "
        "(413MB from its checkpoint folder), so 300MB makes the same refusal",
    ),
]

PROMPT = "Who was Moses?"
PLACEHOLDER = re.compile(r"(?<![\w-])[A-Z][A-Z_]*(?![\w-])|\||\.\.\.")


@dataclass
class DocCommand:
    page: str  # relative to the repository
    line: int
    text: str  # as written (continuations joined)
    output: list[str] = field(default_factory=list)  # the lines the page shows after it
    files: dict[str, str] = field(default_factory=dict)  # `echo X > F` earlier in its block

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def fenced_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(first line number, fence language, lines) of every fenced block."""
    blocks, lang, start, body = [], None, 0, []
    for number, line in enumerate(text.splitlines(), start=1):
        m = re.match(r"^\s*```\s*(\S*)\s*$", line)
        if m and lang is None:
            lang, start, body = m.group(1), number + 1, []
        elif m and not m.group(1):
            blocks.append((start, lang, textwrap.dedent("\n".join(body)).splitlines()))
            lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def runs_smoe(line: str) -> bool:
    """Whether a shell line runs smoe (not `smoe generate: error: ...`, an output line)."""
    return bool(
        re.search(r"(^|&&\s*|\|\s*|--\s+|^(\w+=\S*\s+)+)(smoe|python3? -m smoe\.cli)\s+[a-z]", line)
        and not re.search(r"smoe \w+: ", line)
    )


def doc_commands() -> list[DocCommand]:
    found = []
    for page in PAGES:
        rel = page.relative_to(ROOT).as_posix()
        for start, lang, body in fenced_blocks(page.read_text()):
            if lang not in SHELL_FENCES:
                continue
            lines: list[tuple[int, str]] = []  # backslash continuations joined
            for i, line in enumerate(body):
                if lines and lines[-1][1].endswith("\\"):
                    lines[-1] = (lines[-1][0], lines[-1][1][:-1].rstrip() + " " + line.strip())
                else:
                    lines.append((start + i, line))
            files: dict[str, str] = {}
            if any(line.startswith("$ ") for _, line in lines):  # a session: $ lines run
                current = None
                for number, line in lines:
                    if line.startswith("$ "):
                        cmd = line[2:].strip()
                        echo = re.match(r"""^echo (["'])(.*)\1 > (\S+)$""", cmd)
                        if echo:
                            files[echo.group(3)] = echo.group(2) + "\n"
                        current = None
                        if runs_smoe(cmd):
                            current = DocCommand(rel, number, cmd, files=dict(files))
                            found.append(current)
                    elif current is not None and line.strip():
                        current.output.append(line)
            else:
                for number, line in lines:
                    stripped = line.strip()
                    if runs_smoe(stripped):
                        found.append(DocCommand(rel, number, stripped))
                    elif (
                        found
                        and found[-1].page == rel
                        and stripped.startswith("[")
                        and (line[:1].isspace() and found[-1].line >= start)
                    ):  # a usage synopsis going on
                        found[-1].text += " " + stripped
    return found


@dataclass
class Parsed:
    argv: list[str]  # after `smoe`, placeholders and [groups] as written
    stdin: str | None
    launch: bool
    written: str  # the smoe part, normalized: "smoe CMD ..."


def parse(cmd: DocCommand) -> Parsed:
    """The smoe invocation of a documented line: its argv, and what it reads on stdin."""
    text = cmd.text
    part = next(p for p in re.split(r"\s*&&\s*", text) if runs_smoe(p.strip()))
    stdin = None
    pipe = re.match(r"""^(echo|printf) (["'])(.*?)\2\s*\|\s*(.*)$""", part.strip())
    if pipe:
        data = pipe.group(3)
        stdin = data.replace("\\n", "\n") if pipe.group(1) == "printf" else data + "\n"
        part = pipe.group(4)
    part = re.split(r"\s\|\s", part)[0]  # `smoe ... | grep`: what smoe prints is enough
    launch = part.startswith("mlx.launch ")
    if launch:
        part = part.split(" -- ", 1)[1]
    part = re.sub(r"^(\w+=\S*\s+)+", "", part.strip())  # TMPDIR=$T ...
    part = re.sub(r"^python3? -m smoe\.cli\b", "smoe", part)
    redirect = re.search(r"\s<\s*(\S+)", part)
    if redirect:
        stdin = cmd.files.get(redirect.group(1), PROMPT + "\n")
        part = part[: redirect.start()] + part[redirect.end() :]
    part = re.sub(r"\s\d?>\s*\S+", "", part)  # > /dev/null, > gen.json
    argv = shlex.split(part, comments=True)
    assert argv and argv[0] == "smoe", f"{cmd.id}: cannot read {cmd.text!r}"
    return Parsed(argv[1:], stdin, launch, "smoe " + " ".join(argv[1:]))


def groups(argv: list[str]) -> tuple[list[str], list[str]]:
    """(every token, brackets dropped; the tokens to run: a [group] kept only where it holds
    no placeholder such as `D`, `KEY`, `4|8` or `...`)."""
    every, run, group = [], [], None
    for token in argv:
        if group is None and token.startswith("[") and len(token) > 1 or token == "[":
            group = []
            token = token[1:]
        closes = group is not None and token.endswith("]")
        token = token[:-1] if closes else token
        if token:
            every.append(token)
            (group if group is not None else run).append(token)
        if closes:
            if not any(PLACEHOLDER.search(t) for t in group):
                run += group
            group = None
    return every, run


@pytest.fixture(scope="module")
def smoe_parser():
    from smoe.cli import build_parser

    return build_parser()


def subparser(parser, argv: list[str]):
    """The parser of the (nested) subcommand argv names, and how many tokens named it."""
    import argparse

    used = 0
    while True:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions or used >= len(argv):
            return parser, used
        name = argv[used]
        assert name in actions[0].choices, f"`smoe {' '.join(argv[: used + 1])}`: no such command"
        parser, used = actions[0].choices[name], used + 1


def option_strings(parser) -> dict[str, bool]:
    """Each option string of ``parser`` -> whether it takes a value."""
    return {s: a.nargs != 0 for a in parser._actions for s in a.option_strings}


def passthrough_options(names: list[str]) -> dict[str, bool]:
    """The options of a command whose parser is its module's own (`smoe bench policy`,
    `tiers`: smoe.cli hands them what its parser does not know), read from its --help."""
    import contextlib

    from smoe.cli import main

    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
        main([*names, "--help"])
    usage = help_text.getvalue()
    return {
        o: bool(re.search(rf"{re.escape(o)} [A-Z{{]", usage))
        for o in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", usage)
    }


def options_of(parser, names: list[str]) -> dict[str, bool]:
    if parser.get_default("passthrough"):
        return passthrough_options(names)
    return option_strings(parser)


COMMANDS = doc_commands()


def test_the_docs_show_commands():
    pages = {c.page for c in COMMANDS}
    assert len(COMMANDS) > 40 and {"README.md", "docs/getting-started.md"} <= pages, pages


def test_every_skip_and_adapt_pattern_is_still_used():
    written = [parse(c).written for c in COMMANDS]
    launched = [c.text for c in COMMANDS]
    unused = [
        p
        for p, _ in SKIP
        if not any(re.search(p, w) for w in written) and not any(re.search(p, t) for t in launched)
    ]
    unused += [p for p, _, _ in ADAPT if not any(re.search(p, w) for w in written)]
    assert not unused, f"no documented command matches {unused}: drop them from the tables"


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c.id)
def test_every_documented_flag_exists(cmd, smoe_parser):
    parsed = parse(cmd)
    every, _ = groups(parsed.argv)
    parser, used = subparser(smoe_parser, every)
    known = options_of(parser, every[:used])
    unknown = [
        t.split("=", 1)[0]
        for t in every[used:]
        if t.startswith("-")
        and t != "-"
        and not re.match(r"^-\d", t)
        and t.split("=", 1)[0] not in known
    ]
    assert not unknown, (
        f"{cmd.id}: `{parsed.written}` uses {unknown}, which `smoe {' '.join(every[:used])}` "
        f"does not take (its options: {sorted(known)}): fix the page, or the parser"
    )


# ---------------------------------------------------------------- running them


def skip_reason(cmd: DocCommand, parsed: Parsed) -> str | None:
    text = cmd.text if parsed.launch else parsed.written
    if parsed.launch:
        text = "mlx.launch " + text.split("mlx.launch ", 1)[-1]
    return next((why for pattern, why in SKIP if re.search(pattern, text)), None)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Where the commands run (their relative paths land here), with the demo's checkpoint
    (a download's folder) and its vault exported as mlx-lm writes a model (an
    mlx-community download)."""
    from smoe.chat.demo import DEMO_SOURCE, demo_vault
    from smoe.vault.export import export_mlx
    from smoe.vault.format import Vault

    root = tmp_path_factory.mktemp("docs-commands")
    shutil.copytree(DEMO_SOURCE, root / "demo-download")
    export_mlx(Vault.open(demo_vault()), root / "demo-mlx")
    return root


def substitutions(workspace: Path) -> dict[str, str]:
    from smoe.chat.demo import demo_vault

    vault = str(demo_vault())
    download = str(workspace / "demo-download")
    mlx = str(workspace / "demo-mlx")
    return {
        # a vault, or any model
        "VAULT": vault,
        "MODEL": vault,
        "SRC_OR_VAULT": vault,
        "VAULT_OR_CHECKPOINT": vault,
        "q30-vault": vault,
        "~/.cache/smoe/demo-kjv-qwen3-moe-v2": vault,
        # a Hugging Face download
        "SRC": download,
        "Qwen3-30B-A3B": download,
        "path/to/Qwen3-30B-A3B": download,
        "path/to/Mixtral-8x7B": download,
        "path/to/download": download,
        # an MLX-quantized download
        "path/to/mlx-community-model": mlx,
        "path/to/Qwen3-30B-A3B-4bit": mlx,
        # a prompt
        "...": PROMPT,
    }


WRITES_SECOND = {"convert", "export", "shard"}  # their second positional is what they write


def run_argv(parsed: Parsed, run: list[str], parser, used: int, workspace: Path, n: int):
    """The argv to run: placeholders read as the demo, outputs in fresh folders."""
    subst = substitutions(workspace)
    takes = options_of(parser, run[:used])
    out, positional, value_next = [], 0, False
    for token in run:
        if value_next or token.startswith("-") and token != "-":
            value_next = not value_next and takes.get(token, False) and "=" not in token
            out.append(subst.get(token, token) if token == "..." else token)
            continue
        positional += 1
        if positional == used + 2 and parsed.argv[0] in WRITES_SECOND:
            out.append(str(workspace / f"out-{n}"))  # never the demo's vault
        elif token in subst:
            out.append(subst[token])
        elif token.startswith(("~/", "/data/")):
            out.append(str(workspace / token.lstrip("~/")))
        else:
            out.append(token)
    if parsed.argv[0] in ("generate", "chat") and not {"-n", "--max-tokens"} & set(out):
        out += ["--max-tokens", "8"]
    return out


LABEL = re.compile(r"^([a-z][a-z /]*[a-z])\s{2,}\S")
SHAPES = [  # (a line the page shows, what the command must print now)
    (
        re.compile(r"^memory [\d.]+ [KMG]?B: backbone"),
        re.compile(r"^memory [\d.]+ [KMG]?B: backbone .* \+ KV .* \+ working .* -> ring ", re.M),
    ),
    (
        re.compile(r"^\[\d+ tokens, \w+; first token"),
        re.compile(r"^\[\d+ tokens, \w+; first token [\d.]+ m?s, prefill .* decode ", re.M),
    ),
    (re.compile(r"^warming up the kernels"), re.compile(r"^warming up the kernels", re.M)),
    (
        re.compile(r"^loaded \S+ in [\d.]+ s; computing in"),
        re.compile(r"^loaded \S+ in [\d.]+ s; computing in", re.M),
    ),
    (
        re.compile(r"^wrote \S+: \d+ expert records"),
        re.compile(r"^wrote \S+: \d+ expert records of", re.M),
    ),
]


def labels(lines: list[str]) -> list[str]:
    return [m.group(1) for line in lines if (m := LABEL.match(line))]


def check_shape(cmd: DocCommand, code: int, out: str, err: str) -> None:
    shown = cmd.output
    printed = (out + "\n" + err).strip()
    wants_error = any("error:" in s or "does not fit" in s for s in shown)
    assert code == (1 if wants_error else 0), (
        f"{cmd.id}: `{cmd.text}` exited {code}, where the page shows "
        f"{'an error (exit 1)' if wants_error else 'a run (exit 0)'}:\n{printed[-2000:]}"
    )
    want = labels(shown)
    have = labels(printed.splitlines())
    it = iter(have)
    missing = [label for label in want if label not in it]  # in the page's order
    assert not missing, (
        f"{cmd.id}: the page shows rows {want}; `{cmd.text}` printed {have}: the rows "
        f"{missing} are gone or moved. Update the page's output (or the command)"
    )
    for line in shown:
        for doc_line, now in SHAPES:
            if doc_line.match(line):
                assert now.search(printed), (
                    f"{cmd.id}: the page shows {line[:80]!r}; the command printed no line "
                    f"of that shape ({now.pattern}):\n{printed[-2000:]}"
                )
        error = re.match(r"^smoe (\w+): error: (\S+ \S+ \S+)", line)
        if error:
            assert f"smoe {error.group(1)}: error: {error.group(2)}" in printed, (
                f"{cmd.id}: the page shows the error {line[:100]!r}; the command printed:\n"
                f"{printed[-2000:]}"
            )


RUNNABLE = [c for c in COMMANDS if skip_reason(c, parse(c)) is None and not parse(c).launch]


def test_most_documented_commands_run():
    """The skip table stays the exception: most documented commands run here."""
    assert len(RUNNABLE) >= 25, [c.id for c in RUNNABLE]


def test_every_command_not_run_here_is_listed_with_its_reason():
    """A command the docs show is run below, or matched by the reason table (its flags are
    still checked): a pytest skip would read as a test that never ran (.ci/junit_check.py)."""
    not_run = [c for c in COMMANDS if c not in RUNNABLE]
    unexplained = [c.id for c in not_run if not skip_reason(c, parse(c))]
    assert not unexplained, f"commands neither run nor listed in SKIP: {unexplained}"


@pytest.mark.parametrize("cmd", RUNNABLE, ids=lambda c: c.id)
def test_every_documented_command_runs(cmd, smoe_parser, workspace, run_cli, monkeypatch):
    parsed = parse(cmd)
    _, run = groups(parsed.argv)
    for pattern, swap, _why in ADAPT:
        if re.search(pattern, parsed.written):
            run = [swap.get(t, t) for t in run]
    parser, used = subparser(smoe_parser, run)
    argv = run_argv(parsed, run, parser, used, workspace, COMMANDS.index(cmd))
    monkeypatch.chdir(workspace)
    if parsed.argv[0] == "chat" or parsed.stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(parsed.stdin or PROMPT + "\n"))
    code, out, err = run_cli(*argv)
    if cmd.output:
        check_shape(cmd, code, out, err)
    else:
        assert code == 0, (
            f"{cmd.id}: `{cmd.text}` as `smoe {' '.join(argv)}` exited {code}:\n{err[-2000:]}"
        )


# ---------------------------------------------------------------- links


LINK = re.compile(r"\]\(([^)\s]+)\)")


def link_pages() -> list[Path]:
    return [
        *PAGES,
        ROOT / "results" / "README.md",
        *sorted((ROOT / "results").glob("*/notes-*.md")),
    ]


def test_every_relative_link_resolves():
    broken = []
    for page in link_pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: ({target})")
    assert not broken, f"links to nothing: {broken}: fix each target (relative to its page)"
