"""The packages' layer order (docs/architecture.md, "Layout"): a module imports only from
its own package or from lower layers, never upward; serve/ and chat/ reach the model code
only through the engine; sched/ never imports MLX. Read from the source with ast, every
import counted (inside functions and TYPE_CHECKING blocks too)."""

import ast
from pathlib import Path

import pytest

SMOE = Path(__file__).resolve().parents[2] / "smoe"

# Lowest first. Same-rank packages do not import each other either, unless listed.
LAYERS = [
    {"errors"},
    {"util", "sampling"},
    {"models"},  # (a checkpoint's files are opened with util's open_regular)
    {"vault", "synth"},
    {"sched"},
    {"io", "parallel", "telemetry"},
    {"compute"},
    {"plan"},
    {"engine"},
    {"chat", "serve", "forecast"},
    {"bench"},
    {"commands"},
    {"cli"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _package(path: Path) -> str:
    rel = path.relative_to(SMOE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> list[str]:
    """Every smoe package ``path`` imports (``smoe`` alone: the package's root)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found += [
            n.split(".")[1] if "." in n else "smoe" for n in names if n.split(".")[0] == "smoe"
        ]
    return found


def _modules() -> list[Path]:
    return sorted(p for p in SMOE.rglob("*.py") if p.name != "__init__.py" or p.parent != SMOE)


def test_every_package_has_a_layer():
    packages = {_package(p) for p in _modules()}
    assert packages <= set(RANK), f"give these a layer in LAYERS: {packages - set(RANK)}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SMOE)))
def test_no_module_imports_upward(path):
    own = _package(path)
    upward = [
        dst for dst in _imports(path) if dst not in (own, "smoe") and RANK.get(dst, -1) >= RANK[own]
    ]
    assert not upward, f"{path.relative_to(SMOE)} ({own}) imports {upward}: a layer above it"


def test_the_surfaces_reach_the_model_only_through_the_engine():
    for surface in ("serve", "chat"):
        for path in (SMOE / surface).rglob("*.py"):
            assert "compute" not in _imports(path), f"{path.relative_to(SMOE)} imports compute/"


def test_sched_never_imports_mlx():
    for path in (SMOE / "sched").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "mlx" for a in node.names), path
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.module.split(".")[0] != "mlx", path


def test_the_guard_sees_an_upward_import(tmp_path):
    """The check itself: a vault module that imports the engine is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from smoe.engine.core import Engine\n")
    assert _imports(bad) == ["engine"] and RANK["engine"] > RANK["vault"]


def test_no_module_asks_which_kind_of_model_it_holds():
    """Vault or download: the reader, its host bytes and the backbone's loading are chosen
    by the model's type (smoe.io.open, compute.model.backbone_weights), the rest are
    Vault's own methods; no module branches on isinstance(..., Source)."""
    import re

    asks = re.compile(r"isinstance\([^)]*\bSource\)")
    found = [str(p.relative_to(SMOE)) for p in _modules() if asks.search(p.read_text())]
    assert not found, found


def test_each_kind_of_model_gets_its_own_reader(tmp_path):
    from smoe.io.direct import DirectReader
    from smoe.io.open import open_reader, reader_host_bytes
    from smoe.io.shard_reader import ShardReader
    from smoe.io.unified import UnifiedRing
    from smoe.synth import synthesize
    from smoe.vault.convert import ConvertOptions, convert
    from smoe.vault.source import open_model

    src = synthesize(tmp_path / "src", arch="qwen3_moe", preset="tiny", seed=3)
    vault = convert(src, tmp_path / "v", ConvertOptions(dtype="float32"))
    for model, kind in ((vault, DirectReader), (open_model(src), ShardReader)):
        ring = UnifiedRing(model.manifest.record, 2)
        with open_reader(model, ring, workers=1, direct=True, parts=None) as reader:
            assert type(reader) is kind
        ring.close()
    assert reader_host_bytes(vault, 2) == 0 < reader_host_bytes(open_model(src), 2)
