"""docs/getting-started.md's API clients run as written: its start line is the one `smoe
serve` prints, each client's code takes the base URL that line names for its API, and run
against a server (in a process of its own, as a reader would run it) each prints the
tokenizer's decoding of the engine's own greedy reply."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import pytest

from smoe.engine import Engine
from smoe.sampling import SamplingParams
from smoe.serve.app import ServerOptions
from smoe.serve.listener import base_urls
from tests.conftest import tiny_vault
from tests.serving import Running

pytestmark = pytest.mark.asyncio

DOC = Path(__file__).resolve().parents[2] / "docs" / "getting-started.md"
CLIENTS = {"openai": "OpenAI", "anthropic": "Anthropic", "ollama": "Ollama"}


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    return tiny_vault(tmp_path_factory.mktemp("docs"), seed=11)


def serve_section() -> str:
    text = DOC.read_text()
    start = text.index("## 7. Serve")
    return text[start : text.index("\n## ", start + 1)]


def start_line(section: str) -> tuple[str, dict[str, str]]:
    """The documented start line's base and each API's base URL in it."""
    found = re.search(r"serving \S+ on (http://\S+) \((base URLs: [^)]*)\);", section)
    assert found, "no start line in the serve section"
    base, named = found.group(1), found.group(2)
    assert named == base_urls(base), "the documented start line is not what smoe serve prints"
    urls = dict(re.findall(r"(OpenAI|Anthropic|Ollama) (\S+?)(?:,|$)", named))
    return base, urls


def client_blocks(section: str) -> dict[str, str]:
    """The section's Python blocks, by the client each imports."""
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    found = {}
    for code in blocks:
        names = [n for n in CLIENTS if re.search(rf"^(from|import) {n}\b", code, re.M)]
        assert len(names) == 1, code
        found[names[0]] = code
    assert sorted(found) == sorted(CLIENTS)
    return found


async def run_python(code: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def test_the_documented_clients_run_against_a_server(vault):
    section = serve_section()
    base, urls = start_line(section)
    blocks = client_blocks(section)
    for module, api in CLIENTS.items():
        argument = "host" if module == "ollama" else "base_url"
        assert f'{argument}="{urls[api]}"' in blocks[module], (module, urls[api])
    async with Engine.open(vault.path) as engine, Running(engine, ServerOptions()) as srv:
        tok = engine.tokenizer
        messages = [{"role": "user", "content": "Hello"}]
        ids = list(tok.apply_chat_template(messages, add_generation_prompt=True))
        reply = [
            e.token
            async for e in engine.stream(ids, SamplingParams(temperature=0.0), 16)
            if e.token is not None
        ]
        want = tok.decode(reply) + "\n"
        for module, code in blocks.items():
            printed = await run_python(code.replace(base, srv.base))
            assert printed == want, module
