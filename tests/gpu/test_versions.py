"""The GPU machine runs what pyproject.toml declares: every figure from it is about a
version we support. Its image brings its own packages (transformers 5.17 when checked,
below our floor); bench/gpu/setup.sh carries the ones we need."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.gpu.gpu_common import GPU_MARKS, report

pytestmark = GPU_MARKS
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def declared() -> list[Requirement]:
    """The runtime requirements that apply to this machine (markers evaluated)."""
    data = tomllib.loads(PYPROJECT.read_text())
    reqs = [Requirement(r) for r in data["project"]["dependencies"]]
    return [r for r in reqs if r.marker is None or r.marker.evaluate()]


def test_every_dependency_is_a_version_we_declare():
    found, outside = {}, []
    for req in declared():
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            outside.append(f"{req.name}: not installed")
            continue
        found[req.name] = version
        if not req.specifier.contains(version, prereleases=True):
            outside.append(f"{req.name} {version} not in {req.specifier}")
    report({"test": "versions", "versions": found, "outside": outside})
    if outside:
        pytest.fail("; ".join(outside))
