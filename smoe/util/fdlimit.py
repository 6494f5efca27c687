"""Keep mlx-lm's import from breaking or shrinking the open-file limit.

``mlx_lm/utils.py`` runs ``resource.setrlimit(RLIMIT_NOFILE, (2048, 4096))`` when it is
imported (for models of many shards). Under a hard limit below 4096 (``ulimit -Hn 1024``,
some containers and batch systems) an unprivileged process may not raise it, so the import,
and every S-MoE command that imports mlx-lm, dies with "ValueError: not allowed to raise
maximum limit"; above 4096 it lowers the hard limit for good, which no later code can undo
(a server's clients each hold a descriptor).

``install`` (run by ``import smoe``) adds an import hook that runs that one module's
import with ``setrlimit`` for RLIMIT_NOFILE clamped: the soft limit is raised towards what
mlx-lm asks, never past the hard limit, and the hard limit is left as it is. Nothing else
is touched: the stdlib function is back as it was once the module has run.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

TARGET = "mlx_lm.utils"


def clamp(want: tuple[int, int], have: tuple[int, int], infinity: int) -> tuple[int, int]:
    """The (soft, hard) limits to set for a request of ``want`` when ``have`` is in force:
    the soft limit at least what it is, at most the hard one, which stays."""

    def below(a: int, b: int) -> bool:  # a < b, with ``infinity`` above every number
        return a != b and (b == infinity or (a != infinity and a < b))

    soft, hard = have
    new = want[0] if below(soft, want[0]) else soft
    return (hard if below(hard, new) else new), hard


@contextlib.contextmanager
def clamped_nofile() -> Iterator[None]:
    """``resource.setrlimit`` with RLIMIT_NOFILE requests clamped (``clamp``) for the block."""
    try:
        import resource
    except ImportError:  # Windows: no resource module, and mlx-lm does not set limits
        yield
        return
    real = resource.setrlimit

    def setrlimit(which: int, limits: tuple[int, int]) -> None:
        if which == resource.RLIMIT_NOFILE:
            limits = clamp(tuple(limits), resource.getrlimit(which), resource.RLIM_INFINITY)  # type: ignore[arg-type]
        real(which, limits)

    resource.setrlimit = setrlimit
    try:
        yield
    finally:
        resource.setrlimit = real


class _Loader(importlib.abc.Loader):
    """The module's own loader, its ``exec_module`` run under ``clamped_nofile``."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        with clamped_nofile():
            self.inner.exec_module(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Add the hook (once), unless mlx-lm's utils was imported already (too late then)."""
    if TARGET in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
