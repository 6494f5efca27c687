"""An optional faster BLAS under MLX's CPU matmuls: ``SMOE_CPU_BLAS=PATH``.

MLX's Linux CPU wheel bundles the reference (netlib) BLAS, so its float32 matmuls (a
backbone's attention projections, dense MLPs and LM head when they are not quantized) ran
at a few GFLOP/s on the 2-core development machine, 47x slower than OpenBLAS on the same
matmul (docs/performance.md). A BLAS library named by ``SMOE_CPU_BLAS`` (e.g. Debian's
``libopenblas0-pthread``) is preloaded, so MLX's calls resolve to it. That is another
arithmetic: the output then equals mlx-lm's run under the same preload, not stock
mlx-lm's, so it is opt-in. Quantized matmuls (MLX's own kernels) are unaffected.

A preload must be in place when the process starts, so the ``smoe`` command re-executes
itself once with ``LD_PRELOAD`` set (``reexec_args``); ``in_use`` says which BLAS the
process has.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from smoe.errors import SmoeError

ENV = "SMOE_CPU_BLAS"
BUNDLED = "MLX's bundled reference BLAS"


def _preloaded(env: dict[str, str]) -> list[str]:
    return [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p]


def reexec_args(argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]] | None:
    """The command line and environment to re-execute ``smoe argv`` with ``SMOE_CPU_BLAS``
    preloaded, or None where nothing is to do (unset, already preloaded, or not Linux).
    SmoeError, naming the fix, for a path that is not a file."""
    wanted = env.get(ENV, "").strip()
    if not wanted or not sys.platform.startswith("linux"):
        return None
    path = Path(wanted).expanduser()
    if not path.is_file():
        raise SmoeError(
            f"{ENV}={wanted} is not a file: give a BLAS library's path (e.g. Debian's "
            "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0, from the "
            f"libopenblas0-pthread package), or unset {ENV} for MLX's own"
        )
    if str(path) in _preloaded(env):
        return None
    new_env = {**env, "LD_PRELOAD": " ".join([str(path), *_preloaded(env)])}
    code = "import sys; sys.argv[0] = 'smoe'; from smoe.cli import main; sys.exit(main())"
    # -P: `-c` would put the current directory first on sys.path, and a `smoe/` folder
    # there (e.g. a clone's parent) would be imported instead of the installed package.
    return [sys.executable, "-P", "-c", code, *argv], new_env


def in_use(env: dict[str, str] | None = None) -> str:
    """The BLAS this process's MLX CPU matmuls use: a BLAS library preloaded (by
    ``SMOE_CPU_BLAS`` or by hand), else MLX's bundled reference BLAS."""
    env = dict(os.environ) if env is None else env
    blas = [p for p in _preloaded(env) if "blas" in Path(p).name.lower()]
    return blas[0] if blas else BUNDLED
