"""SMOE_CPU_BLAS (smoe/util/blas.py): the smoe command re-executes itself once with the
named BLAS preloaded under MLX's CPU matmuls, reports which BLAS ran, refuses a bad path
in one line, and under OpenBLAS still equals mlx-lm run in memory under the same BLAS."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from smoe.chat.demo import demo_vault
from smoe.util.blas import BUNDLED

SMOE = shutil.which("smoe") or str(Path(sys.executable).parent / "smoe")
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD")


def mlx_bundled_blas() -> Path:
    import mlx.core as mx

    libs = Path(mx.__file__).resolve().parents[1] / "mlx_cpu.libs"
    found = sorted(libs.glob("libblas*.so*"))
    if not found:
        pytest.skip("this MLX has no bundled BLAS")
    return found[0]


def smoe(
    *args: str, blas: str | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SMOE_CPU_BLAS", "LD_PRELOAD")}
    if blas is not None:
        env["SMOE_CPU_BLAS"] = blas
    return subprocess.run(
        [SMOE, *args], env=env, capture_output=True, text=True, timeout=600, cwd=cwd
    )


def generate(blas: str | None = None) -> dict:
    r = smoe(
        "generate", str(demo_vault()), "--prompt-ids", "5,6,7,8,9", "--max-tokens", "8",
        "--device", "cpu", "--json", blas=blas,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_path_that_is_not_a_file_is_one_line_naming_the_fix():
    r = smoe("generate", str(demo_vault()), "--prompt-ids", "5", blas="/nowhere/libopenblas.so.0")
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "SMOE_CPU_BLAS=/nowhere/libopenblas.so.0 is not a file" in r.stderr
    assert "libopenblas0-pthread" in r.stderr and r.stdout == ""


def test_the_library_is_preloaded_once_and_reported():
    """MLX's own bundled BLAS named explicitly: preloaded, reported, the same tokens."""
    lib = mlx_bundled_blas()
    plain, preloaded = generate(), generate(str(lib))
    assert plain["stats"]["cpu_blas"] == BUNDLED
    assert preloaded["stats"]["cpu_blas"] == str(lib)
    assert preloaded["tokens"] == plain["tokens"]


def test_the_reexec_imports_the_installed_package_from_any_folder(tmp_path):
    """Run from a folder holding a `smoe/` folder (a clone's parent, say), the re-executed
    process still imports the installed smoe, not the folder's."""
    lib = mlx_bundled_blas()
    (tmp_path / "smoe").mkdir()
    (tmp_path / "smoe" / "__init__.py").write_text("raise ImportError('the decoy smoe')\n")
    r = smoe(
        "generate", str(demo_vault()), "--prompt-ids", "5,6", "--max-tokens", "2",
        "--device", "cpu", "--json", blas=str(lib), cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "decoy" not in r.stderr and "Traceback" not in r.stderr
    assert json.loads(r.stdout)["stats"]["cpu_blas"] == str(lib)


@pytest.mark.skipif(not OPENBLAS.exists(), reason="needs Debian's libopenblas0-pthread")
def test_under_openblas_the_engine_equals_mlx_lm_under_openblas():
    """The demo's float backbone runs its matmuls in OpenBLAS: engine and mlx-lm in
    memory, in one process under the same preload, give the same tokens."""
    r = smoe(
        "bench", "resident", str(demo_vault()), "--device", "cpu", "--prompt-tokens", "48",
        "--max-tokens", "16", blas=str(OPENBLAS),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout[r.stdout.index("{") :])
    assert report["tokens_equal"] is True, report
